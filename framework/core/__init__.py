"""The bottom layer: what every other package may use and which imports nothing of the framework's own. `files`
is the one writer of files in a run or checkpoint directory."""
