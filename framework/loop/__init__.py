"""The loop: components built from config (`build`), the run's parts wired (`run`), the fit loop (`trainer`),
validation and test (`evaluate`), the check before training (`preflight`) and stops agreed by every rank (`stop`)."""
