"""This repository's examples of a user's own code: a Task (tasks.py) and a callback (callbacks.py), used by the
presets experiment=digits_penalty, experiment=digits_misclassified and callbacks=metric_history. Not installed
with the framework: a repository of your own has its own packages (the framework's models and data sets are in
framework/zoo/)."""
