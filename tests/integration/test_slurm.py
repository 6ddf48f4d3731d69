"""The repository's sbatch scripts under a real SLURM scheduler (one node, brought up here).

    pytest tests/integration/test_slurm.py

A one-node cluster (munged, slurmctld, slurmd with a slurm.conf in a temporary folder, on free
ports) is started for the module and taken down by PID at its end. Then:

- ``slurm/train.sbatch`` with 2 processes on the tiny preset (waited for to COMPLETED) trains exactly
  as a 2-process ``accelerate launch`` replaying the rollouts the job recorded;
- a training job that gets SIGTERM (``scancel --signal=TERM``, what SLURM sends before a time
  limit or a preemption) writes a checkpoint; the same sbatch command resumes it to the
  parameters of the uninterrupted job;
- ``slurm/build_bank.sbatch`` as a 2-task job array, then a merge job that depends on it
  (``--dependency=afterok``), gives the bank one process builds, byte for byte.

And without a scheduler: what each of 2 nodes x 8 GPUs would launch (stand-in commands; the
launcher's srun asks for the job's CPUs again), what accelerate makes of that launch with the
DeepSpeed configs (each node's own processes through torchrun, not pdsh), and that both scripts
ask for host memory.

Needs Debian's ``slurm-wlm`` and ``munge`` (``.ci/run`` installs them when missing) and root
(munged runs as user munge, the daemons as root). Without them the scheduler tests skip and say why;
``ELASTICMEM_REQUIRE_SLURM=1`` turns that skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, launch_2
from test_build_bank_cli import assert_same_bank_files
from test_train import _env, _metrics, _params, _train_cli, tiny_setup  # noqa: F401  (fixture)
from test_train_distributed import _assert_same_rows

from elasticmem.utils import checkpointing as ckpt
from elasticmem.utils.common import free_port

TOOLS = ("sbatch", "scancel", "squeue", "sinfo", "slurmctld", "slurmd", "munged", "munge")
# 20 short steps (~2.5 s on 2 cores): room for a signal sent after the first to land mid-run
STEPS = 20
# the scripts ask for a GPU node's memory (--mem): more than this machine may have
MEM = "--mem=1G"
TRAIN = (f"train.max_steps={STEPS}", "train.save_every=5", "train.eval_split=", "train.group_size=4",
         "train.warmup_steps=0", "memory.top_z=2")


def _why_not() -> str | None:
    missing = [t for t in TOOLS if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").is_file()]
    if missing:
        return f"SLURM tools not installed: {', '.join(missing)} (apt-get install slurm-wlm munge; .ci/run does)"
    if os.geteuid() != 0:
        return "a local SLURM needs root here (munged as user munge, slurmctld and slurmd as root)"
    return None


class Cluster:
    """A one-node SLURM: its environment (SLURM_CONF) and the daemons' processes."""

    def __init__(self, root: Path):
        self.root = root
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
        self.procs: list[subprocess.Popen] = []
        self.munged_pid: int | None = None

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def run(self, *args: str, env: dict | None = None, check: bool = True, timeout: float = 600):
        p = subprocess.run(args, cwd=ROOT, env={**self.env, **(env or {})}, capture_output=True, text=True,
                           timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"{args} exited {p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}\n{self.logs()}")
        return p

    def wait_gone(self, job: str, timeout: float = 300) -> str:
        """Wait for ``job`` to leave the queue; its final state, e.g. 'COMPLETED'. Polled every
        0.3 s: ``sbatch --wait`` does the same but returned up to 30 s after the job ended here."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.run("squeue", "-h", "-j", job, check=False).stdout.strip():
                info = self.run("scontrol", "show", "job", "-o", job).stdout
                return info.split("JobState=")[1].split()[0]
            time.sleep(0.3)
        raise AssertionError(f"job {job} still queued after {timeout} s\n{self.logs()}")


def _start_munge(c: Cluster) -> None:
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return  # a munged is running already: use it, leave it running
    run_dir = Path("/run/munge")
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    if not Path("/etc/munge/munge.key").is_file():
        subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create"], check=True)
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)  # forks into the background
    pid_file = run_dir / "munged.pid"
    deadline = time.time() + 10
    while not pid_file.is_file() and time.time() < deadline:
        time.sleep(0.1)
    c.munged_pid = int(pid_file.read_text())


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _why_not()
    if why:
        if os.environ.get("ELASTICMEM_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    mem_mb = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 - 1024
    (root / "state").mkdir()
    (root / "spool").mkdir()
    (root / "slurm.conf").write_text(f"""ClusterName=elasticmem-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={mem_mb} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    c = Cluster(root)
    try:
        _start_munge(c)
        for daemon in ("slurmctld", "slurmd"):
            c.procs.append(subprocess.Popen([shutil.which(daemon) or f"/usr/sbin/{daemon}", "-D"], env=c.env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 60
        while time.time() < deadline:
            state = c.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"the node did not come up (state {state!r})\n{c.logs()}")
        yield c
    finally:
        subprocess.run(["scancel", "--full", "--partition=test"], env=c.env, capture_output=True)
        for p in reversed(c.procs):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        if c.munged_pid is not None:
            os.kill(c.munged_pid, signal.SIGTERM)


def _sbatch_train(c: Cluster, root: Path, out: Path, *extra: str, wait: bool = True) -> str:
    """Submit slurm/train.sbatch on the tiny preset with 2 processes on the CPU node; its job id.
    ``wait``: until it leaves the queue, which must be as COMPLETED."""
    args = ["sbatch", "--parsable", "--gpus-per-node=0", f"--cpus-per-task={min(2, os.cpu_count())}", MEM,
            f"--output={out}.slurm.out", "slurm/train.sbatch", "configs/tiny.yaml", f"data.dir={root}/data",
            f"bank.dir={root}/bank", f"train.output_dir={out}", *TRAIN, *extra]
    env = {**_env(), "SLURM_CONF": c.env["SLURM_CONF"], "GPUS_PER_NODE": "2", "MAIN_PORT": str(free_port())}
    job = c.run(*args, env=env).stdout.strip().split(";")[0]
    if wait:
        state = c.wait_gone(job)
        assert state == "COMPLETED", f"job {job}: {state}\n{Path(f'{out}.slurm.out').read_text()[-4000:]}"
    return job


@pytest.fixture(scope="module")
def slurm_run(slurm, tiny_setup, tmp_path_factory):  # noqa: F811
    """An uninterrupted 2-process training job that records its rollouts: (run folder, rollouts)."""
    tmp = tmp_path_factory.mktemp("slurm_train")
    out, rec = tmp / "job", tmp / "rec"
    _sbatch_train(slurm, tiny_setup, out, f"train.record_rollouts={rec}")
    log = Path(f"{out}.slurm.out").read_text()
    assert "[sbatch] nodes=1" in log and "processes/node=2" in log, log[-3000:]
    return out, rec


def test_train_sbatch_equals_a_two_process_accelerate_launch(slurm_run, tiny_setup, tmp_path):  # noqa: F811
    out, rec = slurm_run
    direct = tmp_path / "direct"
    _train_cli(tiny_setup, direct, *TRAIN, f"train.replay_rollouts={rec}", env=_env(ACCELERATE_USE_CPU="1"),
               launcher=launch_2())
    job, ref = _metrics(out), _metrics(direct)
    assert len(job) == STEPS and job[0]["processes"] == 2 and ref[0]["processes"] == 2
    _assert_same_rows(job, ref)
    a, b = _params(out / "final"), _params(direct / "final")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)


def test_sigterm_checkpoints_and_the_resubmitted_job_resumes_to_the_same_parameters(
        slurm, slurm_run, tiny_setup, tmp_path):  # noqa: F811
    out = tmp_path / "preempted"
    job = _sbatch_train(slurm, tiny_setup, out, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline and not ((out / "metrics.jsonl").is_file() and _metrics(out)):
        time.sleep(0.2)
    slurm.run("scancel", "--signal=TERM", job)  # to the job's steps: the launcher and its processes
    slurm.wait_gone(job)
    log = Path(f"{out}.slurm.out").read_text()
    last = ckpt.latest_checkpoint(out / "checkpoints")
    assert "signal 15: stopping after this step" in log, log[-4000:]
    assert last is not None and not (out / "final").exists(), "the job should have stopped before its end"
    stopped = int(last.name.removeprefix("step_"))
    assert stopped == _metrics(out)[-1]["step"] < STEPS  # the checkpoint is of the step it stopped at
    _sbatch_train(slurm, tiny_setup, out)
    log = Path(f"{out}.slurm.out").read_text()
    assert f"step_{stopped:06d}" in log and "resumed from" in log, log[-4000:]
    assert [m["step"] for m in _metrics(out)] == list(range(1, STEPS + 1))
    uninterrupted, _ = slurm_run
    a, b = _params(uninterrupted / "final"), _params(out / "final")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0, msg=name)


def test_bank_array_job_then_dependent_merge_equals_a_one_process_build(slurm, tiny_setup, tmp_path):  # noqa: F811
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, build_bank
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split

    common = ["configs/tiny.yaml", f"data.dir={tiny_setup}/data", "bank.shard_rows=8"]
    # the single-process reference, in this process (what build_bank.py calls)
    cfg = load_config(ROOT / common[0], [*common[1:], f"bank.dir={tmp_path}/one"])
    examples = {split: load_split(cfg.data.dir, split) for split in cfg.bank.splits}
    build_bank(examples, load_backbone(cfg.backbone), cfg.chunking, cfg.bank, torch.float32, show_progress=False)
    env = {**_env(), "SLURM_CONF": slurm.env["SLURM_CONF"]}
    opts = ["--gpus-per-node=0", "--cpus-per-task=1", MEM, f"--output={tmp_path}/bank-%A_%a.out"]
    array = slurm.run("sbatch", "--parsable", "--array=0-1", *opts, "slurm/build_bank.sbatch", *common,
                      f"bank.dir={tmp_path}/array", env=env).stdout.strip().split(";")[0]
    merge = slurm.run("sbatch", "--parsable", f"--dependency=afterok:{array}", *opts, "slurm/build_bank.sbatch",
                      *common, f"bank.dir={tmp_path}/array", env=env).stdout.strip().split(";")[0]
    assert slurm.wait_gone(merge) == "COMPLETED", slurm.logs()
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("bank-*.out")))
    for k in range(2):
        assert f"part {k} of 2" in logs and f"part {k}/2 done" in logs, logs[-4000:]
    assert set(Bank.open(tmp_path / "array", verify=True).manifest["build"]["shard_writers"]) == {0, 1}
    assert_same_bank_files(tmp_path / "one", tmp_path / "array")


def test_two_nodes_each_launch_their_own_rank_on_the_head_node_rendezvous(tmp_path):
    """The multi-node wiring of slurm/train.sbatch, on paper (one machine here): with 2 nodes of 8
    GPUs, stand-ins for scontrol, srun, nvidia-smi and accelerate record what each node would
    launch. Needs no SLURM."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    shims = {
        # scontrol show hostnames gpu-a[1-2]; the pause lets a reader that stops after the first line
        # (head -n 1) close the pipe first, as a long node list does, so a SIGPIPE under pipefail shows
        "scontrol": 'echo "gpu-a1"; sleep 0.3; echo "gpu-a2"',
        "nvidia-smi": "exit 0",
        # srun: record its options, run the step once per node, as each node would, with its own SLURM_NODEID
        "srun": f'printf "<%s>" "${{@:1:$#-3}}" > {tmp_path}/srun; '
                'for i in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$i "${@: -3}"; done',
        # one <argument> each, so that an argument split at a space would show
        "accelerate": f'{{ echo -n "node=$SLURM_NODEID cpu=${{ACCELERATE_USE_CPU:-}} "; printf "<%s>" "$@"; echo; }} '
                      f'>> {tmp_path}/launches',
    }
    for name, body in shims.items():
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    # the submission folder has no .venv, whose activation would put the real accelerate first
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu-a[1-2]",
               SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=str(tmp_path), SLURM_CPUS_PER_TASK="16")
    p = subprocess.run(["bash", str(ROOT / "slurm/train.sbatch"), "configs/quickstart.yaml", "train.lr=1e-4",
                        "memory.suffix_template=Answer: {choices}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    launches = (tmp_path / "launches").read_text().splitlines()
    assert len(launches) == 2
    # the launcher's step asks for the job's CPUs again (srun does not inherit them since Slurm 22.05)
    assert (tmp_path / "srun").read_text() == "<--ntasks=2><--ntasks-per-node=1><--cpus-per-task=16>"
    for rank, line in enumerate(launches):
        assert line.startswith(f"node={rank} cpu= <launch>")
        for part in ("<--num_machines><2>", "<--num_processes><16>", f"<--machine_rank><{rank}>",
                     "<--main_process_ip><gpu-a1>", "<--main_process_port><29500>",
                     "<--config_file><configs/accelerate/multi_gpu.yaml>"):
            assert part in line, (part, line)
        # each override arrives as one argument, spaces included
        assert line.endswith("<train.py><--config><configs/quickstart.yaml><train.lr=1e-4>"
                             "<memory.suffix_template=Answer: {choices}>"), line



def test_sbatch_scripts_ask_for_host_memory():
    """Without --mem a job gets the cluster's default (DefMemPerCPU: often a few GB per CPU), too
    little to load a 7B or train an index; both scripts ask for memory, which the command line's
    --mem overrides (as the scheduler tests above do: this machine may have less)."""
    import re

    for script in ("train.sbatch", "build_bank.sbatch"):
        lines = (ROOT / "slurm" / script).read_text().splitlines()
        assert sum(bool(re.fullmatch(r"#SBATCH --mem=\d+G", x)) for x in lines) == 1, script


@pytest.mark.parametrize("config", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_deepspeed_configs_launch_each_nodes_own_processes(config):
    """What ``accelerate launch`` makes of slurm/train.sbatch's arguments on node 1 of 2 with a
    DeepSpeed config (accelerate's own parsing and launch preparation; nothing is started): the
    node starts its own 8 processes through torchrun (rank 1 of 2 nodes, rendezvous on the head
    node), as the DDP config does; not the ``deepspeed`` runner with pdsh, accelerate's default
    for several machines, which would try to ssh into a hostfile's hosts from each node's task."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args([
        "--config_file", str(ROOT / "configs/accelerate" / config), "--num_machines", "2", "--num_processes", "16",
        "--machine_rank", "1", "--main_process_ip", "gpu-a1", "--main_process_port", "29500",
        "train.py", "--config", "configs/quickstart.yaml"])
    args, defaults, _ = _validate_launch_command(args)
    assert args.use_deepspeed
    args.deepspeed_fields_from_accelerate_config = list(defaults.deepspeed_config)  # as launch_command sets it
    cmd, _ = prepare_deepspeed_cmd_env(args)
    assert cmd is None, cmd  # None: torchrun in this process, not a `deepspeed ... --launcher pdsh` command
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "8")
    assert args.rdzv_endpoint == "gpu-a1:29500"
