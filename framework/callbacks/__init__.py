"""Callbacks: behaviour added to the loop by config, with Lightning's hook names (`base`: `Callback`, and the list
the loop calls), and the built-in ones the `callbacks` config group names."""

from framework.callbacks.base import Callback, CallbackList
from framework.callbacks.early_stopping import EarlyStopping
from framework.callbacks.ema import EMA
from framework.callbacks.grad_norm import GradNormMonitor
from framework.callbacks.timer import Timer

__all__ = ["EMA", "Callback", "CallbackList", "EarlyStopping", "GradNormMonitor", "Timer"]
