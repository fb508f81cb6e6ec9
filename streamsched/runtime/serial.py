"""The reference executor: every task in issue order on the caller's stream/thread."""

from __future__ import annotations

from typing import Any, Optional

from .chaos import Chaos
from .program import Program, run_task
from .synclog import NULL_LOG, SyncLog

__all__ = ["SerialExecutor"]


class SerialExecutor:
    """Runs a program's tasks one after another; with no log, chaos or observer, the
    program's one generated function for the whole call (``Program.call``)."""

    name = "serial"

    def run(
        self,
        program: Program,
        inputs: list[Any],
        log: Optional[SyncLog] = None,
        chaos: Optional[Chaos] = None,
        observer: Any = None,
    ) -> Any:
        if log is None and chaos is None and observer is None:
            call = program.call
            if call is not None:
                return call(inputs)
            env = program.new_env(inputs)
            program.run_serial(env)
            return program.output(env)
        if log is None:
            log = NULL_LOG
        env = program.new_env(inputs)
        for task in program.tasks:
            if chaos is not None:
                chaos.delay(0)
            run_task(task, env, observer, 0)
            log.launch(0, task.id, task.reads, task.writes)
            for slot in task.frees:
                env[slot] = None
                log.free(0, slot)
        log.output(program.output_slots)
        return program.output(env)

    def forget(self, program: Optional[Program] = None) -> None:
        pass  # nothing is kept between calls

    def close(self) -> None:
        pass
