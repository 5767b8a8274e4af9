"""Runs on several nodes: `torchrun --nnodes 2` with c10d rendezvous and no scheduler, then `lmforge slurm` and
`lmforge tokenize --slurm` against a real Slurm (two slurmd nodes on this host, tests/slurm_cluster.py). One training
process per node, gloo; each multi-node run must equal the same run on one node.

Set LMFORGE_SLURM_LONG=1 to add the time-limit test (Slurm's own `--signal=B:TERM@60` before a 2-minute limit; about
two minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.launch.sbatch import JobFiles
from tests.conftest import arch_toml, tiny_llama
from tests.integration.runner import env_one_thread, losses, run_cli
from tests.integration.test_tokenize_train import corpus
from tests.slurm_cluster import SlurmCluster
from tests.spawn import free_port

pytestmark = pytest.mark.slow

RUN = (
    """
max_steps = {max_steps}
output_dir = "{output_dir}"

"""
    + arch_toml(tiny_llama(hidden_size=96, intermediate_size=256, max_position_embeddings=256))
    + """
[data]
type = "fake"
seq_len = 128
batch_tokens = 1024
micro_batch_tokens = 256
vocab_size = 256
mean_doc_len = 40

[optim]
type = "adamw"
lr = 3e-3

[deployment]
num_nodes = {nodes}
procs_per_node = {procs}

[slurm]
job_name = "{name}"
"""
)
STEPS = 80
"""Steps of the runs compared with the local reference: long enough to signal one in the middle."""


def _config(tmp_path: Path, name: str, nodes: int = 2, procs: int = 1, max_steps: int = STEPS) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(RUN.format(max_steps=max_steps, output_dir=tmp_path / name, nodes=nodes, procs=procs, name=name))
    return path


def _env(cluster: SlurmCluster) -> dict[str, str]:
    # The job inherits this environment (sbatch --export=ALL): lmforge's Python first on PATH, one compute thread.
    path = f"{Path(sys.executable).parent}{os.pathsep}{cluster.env['PATH']}"
    return {**cluster.env, "PATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _lmforge(cluster: SlurmCluster, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmforge", *args], env=_env(cluster), cwd=cwd, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def _submit(cluster: SlurmCluster, config: Path, *flags: str) -> str:
    done = _lmforge(cluster, ["slurm", "@", str(config), *flags], config.parent)
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[0]
    assert line.startswith("lmforge slurm: submitted job "), done.stdout
    return line.split()[4].rstrip(":")


def _node_logs(files: JobFiles) -> str:
    # torchrun's c10d rendezvous numbers the ranks in the order the nodes join: rank 0 may be on either node
    return "".join(p.read_text() for p in sorted(files.logs.glob("node_*.log")))


def _describe(files: JobFiles, job_id: str) -> str:
    logs = [files.job_log(job_id), *sorted(files.logs.glob("node_*.log"))]
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs if p.exists())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Per-step losses of the same run on this machine: torchrun, two processes, no Slurm."""
    tmp = tmp_path_factory.mktemp("local")
    done = run_cli(["train", "@", str(_config(tmp, "local"))], nproc=2, timeout=240)
    assert done.returncode == 0, done.stderr
    return losses(tmp / "local")


def test_two_torchrun_agents_without_slurm(tmp_path: Path, reference: list[float]) -> None:
    # What every node of a cluster runs, without the cluster: one torchrun agent per "node", meeting at a c10d store
    config = _config(tmp_path, "agents")
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=agents"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", *rdzv]
    command += ["-m", "lmforge", "train", "@", str(config)]
    out = subprocess.PIPE
    agents = [
        subprocess.Popen(command, env=env_one_thread(), stdout=out, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    assert sum(f"step {STEPS}/{STEPS}" in out for out in outputs) == 1  # rank 0 runs under one of the two agents
    assert losses(tmp_path / "agents") == reference


def test_one_node_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    config = _config(tmp_path, "one", nodes=1, procs=2, max_steps=6)
    job = _submit(slurm_cluster, config)
    files = JobFiles(tmp_path / "one")
    assert slurm_cluster.wait(job, timeout=180) == ("COMPLETED", 0), _describe(files, job)
    assert len(losses(files.run_dir)) == 6
    assert "step 6/6" in files.node_log(0).read_text()
    assert {p.name for p in files.logs.glob("rank_*.log")} == {"rank_0.log", "rank_1.log"}
    assert f"lmforge: job {job}, restart count 0, on 1 node(s)" in files.job_log(job).read_text()
    assert (files.run_dir / "slurm" / "job.sbatch").exists() and (files.run_dir / "config.toml").exists()


def test_two_node_job_equals_local_run(slurm_cluster: SlurmCluster, tmp_path: Path, reference: list[float]) -> None:
    job = _submit(slurm_cluster, _config(tmp_path, "two"))
    files = JobFiles(tmp_path / "two")
    assert slurm_cluster.wait(job, timeout=180) == ("COMPLETED", 0), _describe(files, job)
    assert slurm_cluster.job_field(job, "NodeList") == "lmf-node[1-2]"
    # each node ran one rank: both node logs hold torchrun's output, and rank 1 (node 1) wrote its own log
    assert files.node_log(0).exists() and files.node_log(1).exists() and (files.logs / "rank_1.log").exists()
    assert f"step {STEPS}/{STEPS}" in _node_logs(files)
    assert losses(files.run_dir) == reference


def test_preempted_job_requeues_and_resumes_exactly(
    slurm_cluster: SlurmCluster, tmp_path: Path, reference: list[float]
) -> None:
    job = _submit(slurm_cluster, _config(tmp_path, "pre"), "--slurm.requeue")
    files = JobFiles(tmp_path / "pre")
    metrics = files.run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) > 8):
        assert time.monotonic() < deadline and slurm_cluster.state(job) in ("PENDING", "RUNNING"), _describe(files, job)
        time.sleep(0.05)
    # what a scheduler's preemption does: SIGTERM to the batch script only
    cancel = slurm_cluster.run(["scancel", "--signal=TERM", "--batch", job])
    assert cancel.returncode == 0, cancel.stderr
    assert slurm_cluster.wait(job, timeout=240) == ("COMPLETED", 0), _describe(files, job)
    assert slurm_cluster.job_field(job, "Restarts") == "1"
    log = files.job_log(job).read_text()
    assert f"lmforge: job {job}, restart count 0" in log and f"lmforge: job {job}, restart count 1" in log
    stopped = [line for line in log.splitlines() if "requeueing job" in line]
    assert len(stopped) == 1, log
    step = int(stopped[0].split("stopped at step ")[1].split()[0])
    assert 0 < step < STEPS
    # both ranks saved the stop step, and the second start continued from it: one curve, equal to the local run
    assert (files.run_dir / "checkpoints" / f"step_{step}").is_dir()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(STEPS + 1))
    assert losses(files.run_dir) == reference
    assert f"stopped after step {step} (SIGTERM)" in _node_logs(files)


@pytest.mark.skipif("1" not in (os.environ.get("LMFORGE_SLURM_LONG"), os.environ.get("LMFORGE_LONG")),
                    reason="long mode: set LMFORGE_SLURM_LONG=1 (or LMFORGE_LONG=1)")
def test_time_limit_signal_checkpoints_and_requeues(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    config = _config(tmp_path, "limit", max_steps=100000)
    job = _submit(slurm_cluster, config, "--slurm.requeue", "--slurm.time", "2", "--slurm.signal-before-s", "60")
    files = JobFiles(tmp_path / "limit")
    deadline = time.monotonic() + 150
    while "requeueing job" not in (files.job_log(job).read_text() if files.job_log(job).exists() else ""):
        assert time.monotonic() < deadline, _describe(files, job)
        time.sleep(1)
    slurm_cluster.run(["scancel", job])  # the requeued start would train to the next limit
    assert (files.run_dir / "checkpoints" / "latest").exists()


def test_failed_training_fails_the_job_without_requeue(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # a problem the config check cannot see: the trainer meets it when it builds the validation sets
    config = _config(tmp_path, "fails", nodes=1, procs=2, max_steps=4)
    job = _submit(slurm_cluster, config, "--slurm.requeue", "--val.sets", '["missing"]', "--val.data-dir", "nowhere")
    files = JobFiles(tmp_path / "fails")
    state, code = slurm_cluster.wait(job, timeout=120)
    assert (state, code != 0) == ("FAILED", True), _describe(files, job)
    assert slurm_cluster.job_field(job, "Restarts") == "0"
    assert "lmforge train: error: validation needs tokenizer.name" in _node_logs(files)
    assert f"training exited with status {code}" in files.job_log(job).read_text()


def test_config_error_submits_nothing(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    before = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout
    config = _config(tmp_path, "bad", nodes=2, procs=3)  # 1024 tokens are not 256 x 6 processes
    done = _lmforge(slurm_cluster, ["slurm", "@", str(config)], tmp_path)
    assert done.returncode == 2
    assert "data.batch_tokens" in done.stderr and "(256 x 6 = 1536)" in done.stderr
    assert not (tmp_path / "bad").exists()
    assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout == before


def test_a_gpu_job_that_does_not_fit_is_not_submitted(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # Llama-3-8B on one GPU without activation checkpointing: the plan refuses it before anything is written
    before = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout
    root = Path(__file__).resolve().parents[2]
    args = ["slurm", "@", str(root / "examples/pretrain/llama3-8b.toml"), "--deployment.num_nodes", "1",
            "--deployment.procs_per_node", "1", "--slurm.gpus_per_node", "1", "--model.ac.mode", "none",
            "--output_dir", str(tmp_path / "big")]  # fmt: skip
    done = _lmforge(slurm_cluster, args, tmp_path)
    assert done.returncode == 2, done.stderr
    assert "lmforge slurm: does not fit:" in done.stderr and "GiB over the" in done.stderr
    assert "the job was not submitted" in done.stderr and "planned in" in done.stdout
    assert not (tmp_path / "big").exists()
    assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout == before


def test_sbatch_refusal_shows_slurm_message(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    done = _lmforge(slurm_cluster, ["slurm", "@", str(_config(tmp_path, "nopart")), "--slurm.partition", "nosuch"],
                    tmp_path)  # fmt: skip
    assert done.returncode == 2
    message = " ".join(done.stderr.split())
    assert "lmforge slurm: error: sbatch refused the job" in message
    assert "invalid partition" in message.lower()


def test_tokenize_on_slurm_equals_local(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    from lmforge.prep.tokenizer_train import save_tokenizer_folder, train_bpe

    texts = corpus(200)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    save_tokenizer_folder(train_bpe(texts, vocab_size=400), tmp_path / "tok")
    common = ["tokenize", "corpus.jsonl", "--tokenizer", "tok", "--tasks", "3", "--seed", "5", "--holdout", "0.1"]
    local = _lmforge(slurm_cluster, [*common, "--output", "local", "--holdout-output", "local_ho"], tmp_path)
    assert local.returncode == 0, local.stderr
    (tmp_path / "slurm.toml").write_text('[slurm]\njob_name = "tok"\ncpus_per_task = 1\n')
    remote = _lmforge(
        slurm_cluster,
        [*common, "--output", "sl", "--holdout-output", "sl_ho", "--slurm", "--slurm-config", "slurm.toml", "--wait"],
        tmp_path,
    )
    assert remote.returncode == 0, remote.stderr
    assert "train: submitted Slurm job" in remote.stdout and "holdout: submitted Slurm job" in remote.stdout
    # the same summary lines, and the same files byte for byte
    assert (
        local.stdout.replace("local_ho", "X").replace("local", "X").splitlines()[-2:]
        == (remote.stdout.replace("sl_ho", "X").replace("sl", "X").splitlines()[-2:])
    )
    for mine, theirs in (("local", "sl"), ("local_ho", "sl_ho")):
        names = sorted(p.name for p in (tmp_path / mine).glob("*.ds*"))
        assert names and names == sorted(p.name for p in (tmp_path / theirs).glob("*.ds*"))
        for name in names:
            assert (tmp_path / mine / name).read_bytes() == (tmp_path / theirs / name).read_bytes(), name


def test_tokenize_refusal_and_missing_sbatch(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    from lmforge.prep.tokenizer_train import save_tokenizer_folder, train_bpe

    texts = corpus(20)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    save_tokenizer_folder(train_bpe(texts, vocab_size=300), tmp_path / "tok")
    args = ["tokenize", "c.jsonl", "--tokenizer", "tok", "--output", "out", "--slurm", "--partition", "nosuch"]
    done = _lmforge(slurm_cluster, args, tmp_path)
    assert done.returncode == 2
    assert "invalid partition" in done.stderr.lower() and "sbatch refused the train job" in done.stderr
    assert not any((tmp_path / "out").glob("*.ds"))
    env = {**_env(slurm_cluster), "PATH": str(Path(sys.executable).parent)}
    done = subprocess.run([sys.executable, "-m", "lmforge", *args, "--overwrite"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2 and "sbatch not found on PATH" in " ".join(done.stderr.split())
