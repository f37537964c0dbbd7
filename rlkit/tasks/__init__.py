"""Built-in tasks (prompts + reward + tokenizer). ``rk.tasks.get(name)`` lists them on error."""
from rlkit.tasks.arithmetic import arithmetic
from rlkit.tasks.base import Task

TASKS = {"arithmetic": arithmetic}


def get(name: str, **kwargs) -> Task:
    try:
        factory = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}") from None
    return factory(**kwargs)


__all__ = ["Task", "arithmetic", "get", "TASKS"]
