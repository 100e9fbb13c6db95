"""What a user writes: a `Task` (Lightning's LightningModule contract: the steps, `self.log`, the hooks), what a
step returns (`StepOutput`), the ready-made `ClassificationTask`; the task's hooks as the loop calls them (`hooks`)
and its stateful metrics (`metrics`)."""

from framework.task.task import ClassificationTask, StepOutput, Task

__all__ = ["ClassificationTask", "StepOutput", "Task"]
