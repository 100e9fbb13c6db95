"""The framework's launchers for Hydra's joblib and submitit plugins: each is the plugin's own launcher, whose `launch`
outlives its jobs (framework/app/sweep_launchers.py holds what it does). They live here because Hydra instantiates only
launchers of the `hydra_plugins` namespace. A framework sweep launches through the one that extends the launcher its
config chose (`OUTLIVING`, by `_target_`; framework/app/sweep.py, SweepSummary). Each is defined only where its plugin
is installed (the [sweeps] extra), so that Hydra's scan of this namespace never fails without it. Nothing of the
framework is imported until a launch: every Hydra application in the environment imports this module."""

from __future__ import annotations

from typing import Any, Sequence

OUTLIVING: dict[str, str] = {}  # a plugin's launcher -> the framework's, each by its `_target_`


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


try:
    from hydra_plugins.hydra_joblib_launcher import joblib_launcher
except ImportError:  # no joblib plugin: nothing to extend
    pass
else:

    class JoblibLauncher(joblib_launcher.JoblibLauncher):
        """Hydra's joblib launcher: a worker's death costs the jobs it ran beside, each marked, and the jobs that had
        not started run in a new launch."""

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
            from framework.app.sweep_launchers import outlive_joblib

            return outlive_joblib(self, super().launch, job_overrides, initial_job_idx)

    OUTLIVING[_name(joblib_launcher.JoblibLauncher)] = _name(JoblibLauncher)

try:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
except ImportError:  # no submitit plugin: nothing to extend
    pass
else:

    class LocalLauncher(submitit_launcher.LocalLauncher):
        """Hydra's submitit launcher on this machine: a job that fails or dies costs that job only; a job's tasks
        are its run's ranks."""

        def __call__(self, sweep_overrides: list[str], *args: Any) -> Any:
            from framework.app.sweep_launchers import run_task

            return run_task(super().__call__, sweep_overrides, *args)

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
            from framework.app.sweep_launchers import job_by_job

            return job_by_job(self, super().launch, job_overrides, initial_job_idx, None)

    class SlurmLauncher(submitit_launcher.SlurmLauncher):
        """Hydra's submitit launcher on SLURM: a job that fails or dies costs that job only. Each job is a SLURM job
        of its own, not a task of one array; `array_parallelism` still bounds how many are submitted at once. A job's
        tasks (nodes x tasks_per_node) are its run's ranks."""

        def __call__(self, sweep_overrides: list[str], *args: Any) -> Any:
            from framework.app.sweep_launchers import run_task

            return run_task(super().__call__, sweep_overrides, *args)

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
            from framework.app.sweep_launchers import job_by_job

            return job_by_job(
                self, super().launch, job_overrides, initial_job_idx, self.params.get("array_parallelism")
            )

    OUTLIVING[_name(submitit_launcher.LocalLauncher)] = _name(LocalLauncher)
    OUTLIVING[_name(submitit_launcher.SlurmLauncher)] = _name(SlurmLauncher)
