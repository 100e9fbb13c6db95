"""The bottom layer, which every other package may use and which imports nothing of the framework's own: the user's
error types (`errors`), the one writer of files in run and checkpoint directories (`files`) and run.log's handler
(`runlog`), seeding and RNG capture (`reproducibility`), the stop signals (`signals`), the start-up collector pause
(`startup`), stores named by URL through fsspec (`stores`: the URL checked, its file system, a failure's cause)
and the few version-checked uses of dependencies' internals (`compat`)."""
