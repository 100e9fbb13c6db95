"""The models, data sets and LR schedules the framework's own presets (conf/) build by `_target_`.

They install with the framework, under its name, so a user's own packages (an `experiments/` of their own, in
their own repository) never shadow them, and every preset works from any directory.
"""
