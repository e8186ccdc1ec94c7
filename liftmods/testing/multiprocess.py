"""Run one program as N local JAX processes joined by the distributed runtime.

Each child gets its own ``JAX_NUM_CPU_DEVICES`` CPU devices, gloo
collectives, a coordinator on a free localhost port and its process id in
the environment (``LIFTMODS_COORDINATOR``, ``LIFTMODS_NUM_PROCESSES``,
``LIFTMODS_PROCESS_ID``); :func:`initialize_from_env` reads them. The
parent's ``XLA_FLAGS`` are not passed on. If one child fails, the others are
killed, so a crash never leaves the rest waiting on a collective.

>>> import sys
>>> runs = launch([sys.executable, '-c', 'import os; '
...                'print(os.environ["LIFTMODS_PROCESS_ID"])'],
...               num_processes=2, devices_per_process=1)
>>> [r.stdout.strip() for r in runs]
['0', '1']
"""
import dataclasses
import os
import socket
import subprocess
import tempfile
import time

ENV_COORDINATOR = 'LIFTMODS_COORDINATOR'
ENV_NUM_PROCESSES = 'LIFTMODS_NUM_PROCESSES'
ENV_PROCESS_ID = 'LIFTMODS_PROCESS_ID'


class ProcessFailed(RuntimeError):
  """A launched process exited non-zero or ran past the timeout."""


@dataclasses.dataclass
class Run:
  process_id: int
  returncode: int
  stdout: str
  stderr: str


def free_port() -> int:
  """A TCP port on localhost that nothing listens on right now."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def child_env(process_id: int, num_processes: int, devices_per_process: int,
              port: int, base: dict | None = None) -> dict:
  """The environment of one child: its devices, gloo, its place in the job."""
  env = dict(os.environ if base is None else base)
  env.pop('XLA_FLAGS', None)  # a parent's device count must not leak in
  env.update({
      'JAX_PLATFORMS': 'cpu',
      'JAX_NUM_CPU_DEVICES': str(devices_per_process),
      'JAX_CPU_COLLECTIVES_IMPLEMENTATION': 'gloo',
      ENV_COORDINATOR: f'localhost:{port}',
      ENV_NUM_PROCESSES: str(num_processes),
      ENV_PROCESS_ID: str(process_id),
  })
  return env


def launch(argv, num_processes: int, devices_per_process: int, *,
           timeout: float = 300.0, cwd=None, env: dict | None = None,
           check: bool = True, on_start=None) -> list[Run]:
  """Starts ``argv`` ``num_processes`` times and waits for all of them.

  Returns one :class:`Run` per process (in process order). With ``check``,
  raises :class:`ProcessFailed` naming the first process that failed, with
  the tail of its stderr. As soon as one process fails or the timeout
  passes, the rest are killed. ``on_start(popens)`` is called once all are
  running (a fault test uses it to kill one).
  """
  port = free_port()
  outs = [(tempfile.TemporaryFile('w+'), tempfile.TemporaryFile('w+'))
          for _ in range(num_processes)]
  procs = [subprocess.Popen(
      list(argv), cwd=cwd, stdout=o, stderr=e, text=True,
      env=child_env(i, num_processes, devices_per_process, port, env))
           for i, (o, e) in enumerate(outs)]
  if on_start is not None:
    on_start(procs)
  deadline = time.monotonic() + timeout
  failed = None
  while any(p.poll() is None for p in procs):
    bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
    if bad or time.monotonic() > deadline:
      failed = bad[0] if bad else None
      for p in procs:
        if p.poll() is None:
          p.kill()
      break
    time.sleep(0.05)
  for p in procs:
    p.wait()
  runs = []
  for i, (p, (o, e)) in enumerate(zip(procs, outs)):
    o.seek(0)
    e.seek(0)
    runs.append(Run(i, p.returncode, o.read(), e.read()))
    o.close()
    e.close()
  if check:
    if failed is None:
      failed = next((r.process_id for r in runs if r.returncode), None)
      if failed is None and time.monotonic() > deadline:
        failed = 0
    if failed is not None:
      r = runs[failed]
      raise ProcessFailed(
          f'process {failed} of {num_processes} exited with {r.returncode} '
          f'(the others were stopped); its stderr ends:\n{r.stderr[-3000:]}')
  return runs


def initialize_from_env(timeout_s: int = 60) -> bool:
  """Joins the job described by :func:`child_env`'s variables.

  Calls ``jax.distributed.initialize`` with the coordinator, process count
  and id from the environment, cluster auto-detection off and short
  timeouts (a dead peer is noticed in seconds, not minutes). Returns False,
  doing nothing, when the variables are absent. Call it before any other
  JAX call.
  """
  if ENV_COORDINATOR not in os.environ:
    return False
  import jax  # pylint: disable=import-outside-toplevel
  jax.distributed.initialize(
      coordinator_address=os.environ[ENV_COORDINATOR],
      num_processes=int(os.environ[ENV_NUM_PROCESSES]),
      process_id=int(os.environ[ENV_PROCESS_ID]),
      cluster_detection_method='deactivate',
      initialization_timeout=timeout_s,
      heartbeat_timeout_seconds=10)
  return True
