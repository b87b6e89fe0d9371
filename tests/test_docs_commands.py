"""Every shell command in README.md and docs/**/*.md runs, exactly as written, with only small-run
limits appended, on data this test makes.

The commands are read from the ```` ```bash ```` blocks of the pages (continuation lines joined,
comments dropped). Each one must match a rule of ``RULES`` (a new command that matches none fails
``test_every_documented_command_has_a_rule``). A rule says how the command runs here:

| kind | what runs | why it differs from the page |
|---|---|---|
| train | the command, then ``TRAIN_LIMITS`` (2 batches, 1 epoch, tiny data; a half-epoch warmup where the recipe's is longer than the run) | limits only |
| train, cluster | ``trainer=gpu``/``num_nodes``/8 devices as written, then ``trainer.accelerator=cpu`` and one node of CPU ranks appended | no GPU and one machine here |
| data paths | ``/data/imagenet``, ``/datasets/imagenet``: a small ImageNet-layout tree; ``/data/imagenet-stream``: that tree converted by the page's own ``fastscale-data convert`` command | the user's dataset |
| sweep | the command with limits and 2 trials | an Optuna study of 8 full runs |
| torchrun | two ``torchrun`` launches on this machine, ``NODE_RANK`` 0 and 1, ``MASTER_HOST`` 127.0.0.1, a free port, 1 CPU rank per node instead of 8 GPUs | one machine, no GPU |
| torchrun ``...`` | the planner's calibration under ``torchrun --nproc_per_node 2`` | the page elides the launcher flags |
| srun | a stand-in ``srun`` that starts the tasks with srun's variables, 2 nodes x 1 CPU task instead of 8 GPUs each | no SLURM here |
| 64K experiments | as train, cluster, plus a batch ramp of 4 and ``precision=lars_fp32`` | a 64K batch and fp16 need GPUs |
| make train | ``make -f Makefile -o VENV/.installed train VENV=<this suite's venv> ARGS="<limits>"`` in the test's folder | the environment is set up already; ``make test`` is skipped: it runs this suite |
| flag block | the LightningCLI page's block of ``--trainer...`` flags, appended to the page's first command | it is not a command by itself |
| pip install | ``pip install --dry-run --no-index --no-build-isolation`` of the same target | no network in tests; the resolution against the installed packages and the build of the package metadata run |
| skip | nothing; the reason is in ``RULES`` | see each reason |

Each command starts a Python process that imports torch (seconds each), so the default suite
runs the configuration and data-tool commands; the doctor, training runs, plans, installs,
sweeps, 64K experiment configs, multi-process launches and examples (ten seconds and more each
on 2 cores) are marked slow (``make test-slow``, which CI runs too)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.data_streaming_utils import write_tree
from tests.distributed import run_node_launches

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BIN = Path(sys.executable).parent
# appended to every fastscale-train command: Lightning's own small-run switches and a few images
TRAIN_LIMITS = ("++trainer.limit_train_batches=2 ++trainer.limit_val_batches=1 trainer.max_epochs=1 "
                "trainer.enable_progress_bar=false")
# the ImageNet-sized data settings of the folder / streaming datamodules and 64K experiments
DOCTOR_LIMITS = ("doctor.warmup_steps=1 doctor.steps=3 doctor.compute_steps=1 doctor.loader_batches=2 "
                 "doctor.max_workers=1 doctor.verify_warmup_steps=1 doctor.verify_steps=2")
DATA_LIMITS = "data.batch_size=4 data.resolution=32 data.num_workers=0 data.persistent_workers=false"
ONE_CPU_NODE = "trainer.accelerator=cpu trainer.num_nodes=1 trainer.devices=1"
FINAL = r"final val/top1: \d"
# the recipe's warmup (1 epoch in experiment=large_batch, 5-25 in the 64K experiments) must leave
# room for the decay inside the one epoch run here
SHORT_WARMUP = "callbacks.warmup_decay_lr.warmup_epochs=0.5"


@dataclass(frozen=True)
class Rule:
    """How the commands that ``pattern`` matches run here."""

    pattern: str
    kind: str  # run | torchrun | calibrate | dry_run | fragment | skip
    append: str = ""
    expect: tuple[str, ...] = ()  # regexes the output must match
    files: tuple[str, ...] = ()  # files the command must leave in the working folder
    slow: bool = False
    reason: str = ""
    env: dict = field(default_factory=dict)


RULES: list[Rule] = [
    # install
    Rule(r"^pip install ", "dry_run", slow=True,
         reason="no network in tests: resolved offline against the installed packages, metadata built"),
    # make
    Rule(r"^make train$", "run", append=f'ARGS="{TRAIN_LIMITS}"', expect=(FINAL,), slow=True),
    Rule(r"^make test$", "skip", reason="runs this test suite itself"),
    # Hydra entry point: config only
    Rule(r"^fastscale-train --help$", "run", expect=(r"strategy", r"== Config =="), slow=True),
    Rule(r"^fastscale-train --cfg job$", "run", expect=(r"trainer:", r"strategy:")),
    # SLURM through submitit: needs sbatch and a controller
    Rule(r"^fastscale-train -m hydra/launcher=slurm ", "skip",
         reason="submits sbatch jobs to a SLURM controller; the composed launcher config is tested in "
                "test_train_slurm.py and the same sweep through submitit's local launcher runs below"),
    Rule(r"^fastscale-train -m hydra/launcher=submitit_local ", "run",
         append=f"{TRAIN_LIMITS}", expect=(), files=("multirun",), slow=True),
    # sweeps
    Rule(r"^fastscale-train -m ", "run", append=TRAIN_LIMITS, files=("multirun",), slow=True),
    Rule(r"^fastscale-train hparams_search=(lr_optuna|time_to_target)", "run",
         append=f"{TRAIN_LIMITS} hydra.sweeper.n_trials=2", files=("multirun",), slow=True),
    # the 64K experiment configs: ResNet-50 / AlexNet-BN on GPU nodes
    Rule(r"^fastscale-train experiment=imagenet_\w+_64k ", "run",
         append=f"{TRAIN_LIMITS} {DATA_LIMITS} {ONE_CPU_NODE} {SHORT_WARMUP} precision=lars_fp32 "
                "callbacks.batch_size_ramp.schedule={0:4} callbacks.batch_size_ramp.max_per_device_batch=4",
         expect=(FINAL,), slow=True,
         reason="GPU nodes and a 64K batch: one CPU rank, batch 4, fp32 LARS (no fp16 on the CPU)"),
    Rule(r"^fastscale-train .*trainer=gpu", "run", append=f"{TRAIN_LIMITS} {DATA_LIMITS} {ONE_CPU_NODE}",
         expect=(FINAL,), slow=True, reason="no GPU here: the same run on one CPU rank"),
    # the documented streaming and single-process runs: a small batch
    Rule(r"^fastscale-train data=streaming ", "run", append=f"{TRAIN_LIMITS} data.batch_size=4",
         expect=(FINAL,), slow=True),
    Rule(r"^fastscale-train model=alexnet_bn data\.resolution=64$", "run", append=TRAIN_LIMITS, expect=(FINAL,),
         slow=True),
    Rule(r"^fastscale-train hydra\.run\.dir=outputs/job-\$\{SLURM_JOB_ID\} resume=auto$", "run",
         append=TRAIN_LIMITS, expect=(FINAL,), files=("outputs/job-4242",), env={"SLURM_JOB_ID": "4242"},
         slow=True),
    Rule(r"^fastscale-train .*experiment=large_batch", "run", append=f"{TRAIN_LIMITS} {SHORT_WARMUP}",
         expect=(FINAL,), slow=True),
    # every other fastscale-train command: a short run
    Rule(r"^fastscale-train ", "run", append=TRAIN_LIMITS, expect=(FINAL,), slow=True),
    # multi-node launchers
    Rule(r"^torchrun --nnodes 2 --node_rank \$NODE_RANK .*fastscale-doctor", "torchrun",
         append=f"{DOCTOR_LIMITS} {DATA_LIMITS}", expect=(r"bottleneck",), slow=True,
         reason="two nodes of 8 GPUs: two launches on this machine, one CPU rank each"),
    Rule(r"^srun --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 fastscale-doctor ", "srun",
         append=f"{DOCTOR_LIMITS} {DATA_LIMITS}", expect=(r"bottleneck",), slow=True,
         reason="no SLURM here: a stand-in srun starts the tasks with srun's variables, 2 nodes x 1 CPU task"),
    Rule(r"^torchrun --nnodes 2 --node_rank \$NODE_RANK ", "torchrun",
         append=f"{TRAIN_LIMITS}", expect=(FINAL,), slow=True,
         reason="two nodes of 8 GPUs: two launches on this machine, one CPU rank each"),
    Rule(r"^TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc_per_node 8 --max_restarts ", "torchrun", append=TRAIN_LIMITS,
         expect=(FINAL,), slow=True,
         reason="1 or 2 nodes of 8 GPUs: two elastic launches on this machine, one CPU rank each (a node "
                "lost or leaving: test_faults_elastic_launch.py)"),
    Rule(r"^(srun fastscale-train |status=\$\?$|if \[ \$status |exit \$status$)", "skip",
         reason="the SLURM batch script: needs sbatch's allocation and scontrol; the resume on another node "
                "count it relies on runs in test_faults_elastic_launch.py and test_faults_resume_elastic.py"),
    Rule(r"^torchrun \.\.\. -m lightning_fastscale\.planner\.calibrate ", "calibrate", files=("params.json",),
         slow=True, reason="the page elides the launcher flags: two local ranks"),
    Rule(r"^srun --nodes 2 --ntasks-per-node 8 --gpus-per-node 8 ", "srun", append=TRAIN_LIMITS,
         expect=(FINAL,), slow=True,
         reason="no SLURM here: a stand-in srun starts the tasks with srun's variables, 2 nodes x 1 CPU task"),
    # planner
    Rule(r"^fastscale-plan resnet50 tencent_p40_100g$", "run", expect=(r"\S",), slow=True),
    Rule(r"^fastscale-plan .*--json$", "run", expect=(r'"algorithm"',), slow=True),
    Rule(r"^fastscale-plan .*--plot scaling\.png$", "run", files=("scaling.png",), slow=True),
    Rule(r"^fastscale-plan --list-clusters$", "run", expect=(r"tencent_p40_100g",), slow=True),
    Rule(r"^fastscale-plan ", "run", expect=(r"\S",), slow=True),
    # data tools
    Rule(r"^fastscale-data convert ", "run", files=("stream/train/index.json",)),
    Rule(r"^fastscale-data verify ", "run", expect=(r"samples read and decoded, 0 problem",)),
    # the doctor: its own small-run limits (steps of the measured run, compute and loader probes)
    Rule(r"^fastscale-doctor$", "run", append=f"{DOCTOR_LIMITS} {DATA_LIMITS}", expect=(r"bottleneck",),
         slow=True),
    Rule(r"^fastscale-doctor ", "run", append=f"{DOCTOR_LIMITS} {DATA_LIMITS}", expect=(r"bottleneck",),
         slow=True),
    Rule(r"^fastscale-data bench ", "run", append="--batches 2 --warmup 1 --resolution 32 --batch-size 4",
         expect=(r"\S",), slow=True),
    # examples
    Rule(r"^python examples/lightning_cli\.py fit .*--print_config", "run", expect=(r"trainer:",), slow=True),
    Rule(r"^python examples/lightning_cli\.py fit ", "run",
         append="--trainer.max_epochs=1 --trainer.limit_train_batches=2 --trainer.limit_val_batches=1",
         slow=True),
    Rule(r"^python examples/imagenet_\w+\.py --fast-dev-run", "run", slow=True),
    # a block of flags that the page adds to its first command
    Rule(r"^--trainer\.", "fragment"),
]


# srun on one machine: starts nodes x ntasks-per-node copies of the command with the variables
# srun gives each task (what Lightning's SLURMEnvironment reads); the first to fail stops the rest
SRUN_STAND_IN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
opts = {{}}
while args[0].startswith("--"):
    opts[args[0]] = args[1]
    args = args[2:]
nodes, per_node = int(opts["--nodes"]), int(opts["--ntasks-per-node"])
procs = []
for rank in range(nodes * per_node):
    env = dict(os.environ, SLURM_NTASKS=str(nodes * per_node), SLURM_NTASKS_PER_NODE=str(per_node),
               SLURM_NNODES=str(nodes), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
               SLURM_NODEID=str(rank // per_node), SLURM_NODELIST="localhost")
    procs.append(subprocess.Popen(args, env=env))
codes = [p.wait(timeout=600) for p in procs]
sys.exit(max(codes, key=abs))
"""


@dataclass
class Command:
    page: str
    line: int
    text: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def documented_commands() -> list[Command]:
    """Every command of every ```` ```bash ```` block, continuation lines joined, comments dropped."""
    found: list[Command] = []
    for page in PAGES:
        source = page.read_text()
        for block in re.finditer(r"^```bash\n(.*?)^```", source, re.S | re.M):
            first = source[: block.start()].count("\n") + 2
            pending, start = "", first
            for n, raw in enumerate(block.group(1).splitlines(), first):
                line = re.sub(r"(^|\s+)#.*$", "", raw).rstrip()  # no '#' inside the commands
                if not pending:
                    start = n
                if not line.strip():
                    continue
                if line.endswith("\\"):
                    pending += line[:-1].strip() + " "
                    continue
                found.append(Command(str(page.relative_to(ROOT)), start, pending + line.strip()))
                pending = ""
            assert not pending, f"{page}: a block ends on a continuation line"
    return found


def rule_for(command: str) -> Rule | None:
    return next((r for r in RULES if re.search(r.pattern, command)), None)


COMMANDS = documented_commands()


def test_every_documented_command_has_a_rule() -> None:
    assert len(COMMANDS) >= 40, f"only {len(COMMANDS)} commands found in the docs"
    missing = [f"{c.id}: {c.text}" for c in COMMANDS if rule_for(c.text) is None]
    assert not missing, "commands in the docs with no rule in RULES (add one):\n" + "\n".join(missing)
    for c in COMMANDS:
        rule = rule_for(c.text)
        assert rule.kind != "skip" or rule.reason, f"{c.id}: a skip needs its reason"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working folder laid out as a checkout: examples/, the user's dataset, a cluster file."""
    work = tmp_path_factory.mktemp("docs_commands")
    (work / "examples").symlink_to(ROOT / "examples")
    (work / "pyproject.toml").symlink_to(ROOT / "pyproject.toml")
    write_tree(work / "imagenet", train_per_class=8, val_per_class=4)
    shutil.copy(ROOT / "lightning_fastscale/planner/clusters/emulated_local.yaml", work / "my_cluster.yaml")
    return work


def localize(text: str, work: Path) -> str:
    """The user's dataset paths point at the data this test made."""
    for path, ours in (("/data/imagenet-stream", work / "stream"), ("/data/imagenet", work / "imagenet"),
                       ("/datasets/imagenet", work / "imagenet")):
        text = re.sub(re.escape(path) + r"(?=\s|$)", str(ours), text)
    return text


def environment(extra: dict) -> dict:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "WANDB_MODE": "offline", **extra}
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_shell(script: str, work: Path, env: dict, timeout: int = 280) -> subprocess.CompletedProcess:
    """``bash -c script``; past ``timeout`` its whole process group (the ranks it started) is killed."""
    proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=environment(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(script, proc.returncode, out, err)


def run_command(c: Command, rule: Rule, work: Path) -> str:
    text = localize(c.text, work)
    if rule.kind == "dry_run":
        script = text.replace("pip install ", f"{BIN}/python -m pip install --dry-run --no-index --no-build-isolation ", 1)
        done = run_shell(script, work, {})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr
    if c.text.startswith("make "):
        # the suite's own environment is the Makefile's VENV, already set up (-o: not remade)
        venv = BIN.parent
        if not (venv / ".installed").exists():
            pytest.skip(f"{venv} was not made by `make setup`")
        text = f"make -f {ROOT}/Makefile -o {venv}/.installed {text[5:]} VENV={venv} {rule.append}"
    elif rule.kind == "torchrun":
        port = free_port()
        text = text.replace("--nproc_per_node 8", "--nproc_per_node 1").replace("trainer.devices=8", "trainer.devices=1")
        text = f"{text} trainer.accelerator=cpu {rule.append}".replace(":29500", f":{port}")
        codes, out = run_node_launches(text, work, environment({"MASTER_HOST": "127.0.0.1", **rule.env}))
        assert codes == [0, 0], out[-6000:]
        return out
    elif rule.kind == "srun":
        text = text.replace("--ntasks-per-node 8 --gpus-per-node 8", "--ntasks-per-node 1")
        text = text.replace("trainer.devices=8", "trainer.devices=1")
        text = f"{text} trainer.accelerator=cpu {rule.append}"
        stand_in = work / "bin" / "srun"
        stand_in.parent.mkdir(exist_ok=True)
        stand_in.write_text(SRUN_STAND_IN.format(python=sys.executable))
        stand_in.chmod(0o755)
        env = {**rule.env, "PATH": f"{stand_in.parent}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
               "SLURM_JOB_ID": str(20000 + free_port() % 9000), "SLURM_JOB_NAME": "train"}
        done = run_shell(text, work, env)
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{text}\nexit {done.returncode}\n{out[-6000:]}"
        return out
    elif rule.kind == "calibrate":
        text = text.replace("torchrun ...", "torchrun --standalone --nproc_per_node 2")
    else:
        text = f"{text} {rule.append}".strip()
    done = run_shell(text, work, rule.env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{text}\nexit {done.returncode}\n{out[-6000:]}"
    return out


def cases():
    for c in COMMANDS:
        rule = rule_for(c.text)
        if rule is None or rule.kind == "fragment":
            continue
        if rule.kind == "skip":
            continue
        # a block of flags on the page extends the page's first command (its base config)
        if c is next(x for x in COMMANDS if x.page == c.page):
            for frag in (x for x in COMMANDS if x.page == c.page and getattr(rule_for(x.text), "kind", "") == "fragment"):
                yield pytest.param(Command(c.page, c.line, f"{c.text} {frag.text}"), rule,
                                   id=f"{c.id}+{frag.line}", marks=[pytest.mark.slow])
        yield pytest.param(c, rule, id=c.id, marks=[pytest.mark.slow] if rule.slow else [])


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("command", "rule"), list(cases()))
def test_documented_command_runs(command: Command, rule: Rule, workdir: Path) -> None:
    if "/data/imagenet-stream" in command.text and not command.text.startswith("fastscale-data convert"):
        stream_from_docs(workdir)
    if command.text.startswith("fastscale-data convert"):
        shutil.rmtree(workdir / "stream", ignore_errors=True)  # convert refuses an existing folder
    out = run_command(command, rule, workdir)
    for pattern in rule.expect:
        assert re.search(pattern, out), f"{command.text}: no {pattern!r} in the output:\n{out[-4000:]}"
    for name in rule.files:
        assert (workdir / name).exists(), f"{command.text}: {name} was not written"
    if "--json" in command.text:
        # the document starts on a line of its own; the launcher's lines may follow it
        start = re.search(r"^\{$", out, re.M)
        assert start, f"{command.text}: no JSON document in the output"
        json.JSONDecoder().raw_decode(out[start.start():])


def stream_from_docs(work: Path) -> None:
    """The streaming folder, made by the page's own ``fastscale-data convert`` command."""
    if (work / "stream" / "train" / "index.json").exists():
        return
    convert = next(c for c in COMMANDS if c.text.startswith("fastscale-data convert"))
    run_command(convert, rule_for(convert.text), work)
    assert (work / "stream" / "train" / "index.json").exists()
