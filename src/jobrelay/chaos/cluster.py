"""The soak's jobrelay processes, kept running by a supervisor the way a deployment would.

Every role is a real ``python -m jobrelay ROLE`` process configured only through
``JOBRELAY_*`` variables. Whenever one exits (killed, crashed at a fault point, or gave up
because a service was down) the supervisor starts the next incarnation, as systemd or
Kubernetes would, and remembers how and when it ended. A crash at a fault point is armed by
starting the next incarnation with that fault in ``JOBRELAY_FAULTS``; it fires once, the
process dies with the crash exit code, and the incarnation after it runs clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from jobrelay.observe.faults import CRASH_EXIT_CODE

STOP_TIMEOUT = 20.0  # SIGTERM → exit, before SIGKILL


@dataclass(frozen=True)
class Exit:
    role: str
    incarnation: int
    code: int
    cause: str  # sigkill | fault | restart | stopped | unexpected
    at: float  # seconds since the soak started
    lived: float


@dataclass
class Role:
    name: str
    argv: list[str]
    permanent_faults: str = ""
    incarnation: int = 0
    armed: str | None = None
    proc: asyncio.subprocess.Process | None = None
    _killing: bool = False
    _restarting: bool = False
    _stopping: bool = False
    _fired: asyncio.Future[Exit] | None = None
    exits: list[Exit] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def faults(self) -> str:
        return ",".join(f for f in (self.permanent_faults, self.armed or "") if f)


class Cluster:
    def __init__(self, roles: list[Role], env: dict[str, str], log_dir: Path) -> None:
        self.roles = {role.name: role for role in roles}
        self.env = env
        self.log_dir = log_dir
        self.started = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []
        self._spawned: dict[str, asyncio.Event] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def exits(self) -> list[Exit]:
        return sorted((e for r in self.roles.values() for e in r.exits), key=lambda e: e.at)

    async def start(self) -> None:
        for role in self.roles.values():
            self._spawned[role.name] = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._keep(role), name=f"keep-{role.name}"))
        for event in self._spawned.values():
            await event.wait()

    async def _spawn(self, role: Role) -> asyncio.subprocess.Process:
        role.incarnation += 1
        env = {**self.env, "JOBRELAY_FAULTS": role.faults()}
        with (self.log_dir / f"{role.name}.log").open("ab") as log:
            log.write(f"--- incarnation {role.incarnation} faults={role.faults()!r}\n".encode())
            log.flush()
            return await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "jobrelay",
                *role.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C reaches the soak alone, which stops these
            )

    async def _keep(self, role: Role) -> None:
        """Run the role until the cluster stops, starting a new incarnation after every exit."""
        while not role._stopping:
            role.proc = await self._spawn(role)
            self._spawned[role.name].set()
            born = time.monotonic()
            code = await role.proc.wait()
            lived = time.monotonic() - born
            if role._stopping:
                cause = "stopped"
            elif role._killing and code == -signal.SIGKILL:
                cause = "sigkill"
            elif role._restarting and code in (0, -signal.SIGTERM):
                cause = "restart"  # (-SIGTERM: asked to stop before it could drain)
            elif code == CRASH_EXIT_CODE:
                cause = "fault"  # also a second armed process that fired while being disarmed
            else:
                cause = "unexpected"
            ended = Exit(role.name, role.incarnation, code, cause, self.elapsed(), lived)
            role.exits.append(ended)
            role._killing = role._restarting = False
            if cause == "fault":
                role.armed = None
                if role._fired is not None and not role._fired.done():
                    role._fired.set_result(ended)
            if role._stopping:
                break
            # A process that could not even start (a service is down) is not restarted hot.
            await asyncio.sleep(0.3 if lived > 3 else 1.5)

    async def kill9(self, name: str) -> int | None:
        """SIGKILL the role's current process; its pid, or None if none was running."""
        role = self.roles[name]
        pid = role.pid
        if pid is None or role.proc is None:
            return None
        role._killing = True
        with contextlib.suppress(ProcessLookupError):
            role.proc.send_signal(signal.SIGKILL)
        return pid

    async def restart(self, name: str) -> None:
        """SIGTERM: the process drains and exits, and the supervisor starts the next one."""
        role = self.roles[name]
        if role.proc is not None and role.proc.returncode is None:
            role._restarting = True
            with contextlib.suppress(ProcessLookupError):
                role.proc.send_signal(signal.SIGTERM)

    async def crash_at(self, names: list[str], fault: str, timeout: float) -> Exit | None:
        """Restart ``names`` with ``fault`` armed; the first crash it causes (None if none).

        Arming and disarming are graceful restarts (SIGTERM, drain), as a deploy would do,
        so only the crash itself costs work in flight. Arming several processes at once is
        for points only some of the traffic reaches (an e-mail job may happen to go to the
        other worker for a long while); those that did not fire are restarted clean, so no
        armed process outlives this call.
        """
        loop = asyncio.get_running_loop()
        roles = [self.roles[name] for name in names]
        for role in roles:
            role._fired = loop.create_future()
            role.armed = fault
            await self.restart(role.name)
        waiting = [r._fired for r in roles if r._fired is not None]
        try:
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when="FIRST_COMPLETED")
            return next(iter(done)).result() if done else None
        finally:
            for role in roles:
                if role.armed is not None:
                    role.armed = None  # the next incarnation runs clean
                    await self.restart(role.name)
                role._fired = None

    async def stall_at(
        self,
        names: list[str],
        fault: str,
        timeout: float,
        during: Callable[[], Awaitable[str]],
    ) -> tuple[str | None, str]:
        """Restart ``names`` with a ``stall`` fault armed (``point:stall:SECONDS:1``); once
        one of them logs that it stalls there, holding its work at that hand-off, run
        ``during`` (a failover) while it is held. The role that stalled (None if none did
        within ``timeout``) and what ``during`` said. Disarmed after, once the stall is over,
        by graceful restarts as ``crash_at`` does."""
        point, _, rest = fault.partition(":")
        seconds = float(rest.split(":")[1])
        logs = {name: self.log_dir / f"{name}.log" for name in names}
        sizes = {name: (path.stat().st_size if path.exists() else 0) for name, path in logs.items()}
        for name in names:
            self.roles[name].armed = fault
            await self.restart(name)
        stalled: str | None = None
        detail = "never reached the point"
        deadline = time.monotonic() + timeout
        try:
            while stalled is None and time.monotonic() < deadline:
                for name, path in logs.items():
                    if _logged_fault(path, sizes[name], point):
                        stalled = name
                        break
                else:
                    await asyncio.sleep(0.05)  # polling the processes' logs for the stall
            if stalled is not None:
                fired = time.monotonic()
                detail = await during()
                await asyncio.sleep(max(0.0, seconds - (time.monotonic() - fired)) + 0.5)
            return stalled, detail
        finally:
            for name in names:
                role = self.roles[name]
                if role.armed is not None:
                    role.armed = None
                    await self.restart(name)

    async def stop(self) -> None:
        """SIGTERM every process (they drain), SIGKILL what is still up after the timeout."""
        for role in self.roles.values():
            role._stopping = True
            if role.proc is not None and role.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    role.proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(STOP_TIMEOUT):
                await asyncio.gather(*self._tasks, return_exceptions=True)
        except TimeoutError:
            for role in self.roles.values():
                if role.proc is not None and role.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        role.proc.send_signal(signal.SIGKILL)
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _logged_fault(path: Path, offset: int, point: str) -> bool:
    """Whether the log at ``path``, from ``offset``, has a ``fault_fired`` line for ``point``
    (a JSON line of the process's own logging)."""
    try:
        with path.open("rb") as log:
            log.seek(offset)
            tail = log.read().decode(errors="replace")
    except OSError:
        return False
    return any(
        '"fault_fired"' in line and f'"point":"{point}"' in line for line in tail.splitlines()
    )
