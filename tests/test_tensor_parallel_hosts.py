"""Two "hosts" on loopback: node 0 serves HTTP with rank 0, a headless node 1 runs rank 1, both
joined through torch.distributed's TCP rendezvous with vLLM's flags. Greedy tokens equal one
rank's; when node 0 stops, the headless node's worker ends and it exits, leaving no process."""

from __future__ import annotations

import subprocess
import sys

import httpx
from conftest import ServerProcess, free_port, make_prompts
from test_executor import alive, assert_gone, worker_pids
from test_tensor_parallel import build_case_dir

from engine import LLM, SamplingParams

MAX_NEW = 10


def test_two_hosts_through_the_rendezvous_flags_give_one_ranks_tokens(tmp_path):
    path = build_case_dir(tmp_path / "llama", "llama")
    prompts = make_prompts(3, seed=11, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    one = LLM(str(path), dtype="float32")
    expected = [o.outputs[0].text for o in one.generate(prompts, params, use_tqdm=False)]

    port = free_port()
    flags = ["--dtype", "float32", "--tensor-parallel-size", "2", "--nnodes", "2"]
    flags += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    log = open(tmp_path / "headless.log", "w")
    headless = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", str(path), *flags]
        + ["--node-rank", "1", "--headless"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    leader = ServerProcess(str(path), *flags, "--node-rank", "0")
    try:
        leader.wait_ready()
        assert len(worker_pids(leader.proc.pid)) == 1  # rank 0 here, rank 1 on the other host
        headless_workers = worker_pids(headless.pid)
        assert len(headless_workers) == 1
        got = []
        for ids in prompts:
            body = {"model": str(path), "prompt": ids, "max_tokens": MAX_NEW}
            body |= {"temperature": 0, "ignore_eos": True}
            r = httpx.post(leader.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == expected
        leader_workers = worker_pids(leader.proc.pid)
        assert leader.stop() == 0  # SIGTERM: drained, shut the ranks down
        code = headless.wait(60)
        assert code == 0, (tmp_path / "headless.log").read_text()[-4000:]  # ended with the group
        assert_gone(leader_workers + headless_workers)
    finally:
        leader.stop()
        if headless.poll() is None:
            headless.kill()
            headless.wait()
        log.close()
    assert not alive(headless.pid)
    assert "joined the rendezvous at 127.0.0.1" in (tmp_path / "headless.log").read_text()
