"""Callbacks: behaviour added to the loop by config, with Lightning's hook names (`base`: `Callback`, the list the
loop calls), and the built-in ones the `callbacks` config group names."""

from framework.callbacks.base import EMA, Callback, CallbackList, EarlyStopping, GradNormMonitor, Timer

__all__ = ["EMA", "Callback", "CallbackList", "EarlyStopping", "GradNormMonitor", "Timer"]
