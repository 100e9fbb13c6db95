"""The entry: the command line (`cli`), validation at the edge and the run directory (`main`, `rundir`), which run
and checkpoint a resume continues (`resume`), launching processes (`launch`), sweeps and their summary (`sweep`,
`sweep_launchers`)."""
