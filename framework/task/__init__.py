"""What a user writes: a `Task` (Lightning's LightningModule contract: the steps, `self.log`, the hooks; `task`), what
a step returns (`StepOutput`), the ready-made `ClassificationTask` (`classification`); the task's hooks as the loop
calls them (`hooks`), its stateful metrics (`metrics`) and how a value is named in an error line (`describe`)."""

from framework.task.classification import ClassificationTask
from framework.task.task import StepOutput, Task

__all__ = ["ClassificationTask", "StepOutput", "Task"]
