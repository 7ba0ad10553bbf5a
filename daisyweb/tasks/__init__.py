"""What a group trains (``--task module:Name``): the task interface and its loader.

The built-in GPT (``tasks.gpt``) is the task a run names none of; ``tasks.teacher`` is a
second, small one that is not a language model; ``examples/task_template.py`` and
``docs/tasks.md`` show how to write one's own.
"""

from daisyweb.tasks.base import (
    MAX_TASK_FIELDS,
    FieldSpec,
    Task,
    TaskError,
    check_task_config,
    load_task,
    run_fields,
    task_hash,
)

__all__ = ["MAX_TASK_FIELDS", "FieldSpec", "Task", "TaskError", "check_task_config",
           "load_task", "run_fields", "task_hash"]
