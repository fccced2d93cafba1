"""The serving benchmarks run end to end on CPU with the bundled tiny model (tiny sizes), so that the
GPU runs they are made for find them working: `pytest -m slow tests/bench/test_bench_smoke.py` before
a GPU session (about 100 s on 2 cores, outside the default suite's 15 minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], check=False,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_serve_throughput_side_by_side_on_cpu(tmp_path):
    out = tmp_path / "serve.json"
    _run("serve_throughput.py", "--concurrency", "1,3", "--prompt-len", "8", "--max-tokens", "4",
         "--logprobs", "2", "--loop-prompts", "1", "--output", str(out))
    result = json.loads(out.read_text())
    for side in ("embedded", "hf_generate"):
        for key in ("0:1", "0:3", "2:1", "2:3"):
            r = result[side][key]
            assert r["tokens"] == 4 * int(key.split(":")[1]) and r["tokens_per_s"] > 0
    assert result["embedded"]["0:3"]["first_wave_tokens_per_s"] > 0
    assert result["hf_generate"]["0:3"]["first_call_tokens_per_s"] > 0
    assert result["hf_generate"]["0:loop"]["tokens"] == 4


@pytest.mark.slow
def test_serve_throughput_group_shape_on_cpu(tmp_path):
    out = tmp_path / "groups.json"
    _run("serve_throughput.py", "--concurrency", "4", "--prompt-len", "40", "--max-tokens", "3",
         "--group-size", "2", "--skip-hf", "--log-steps", "--output", str(out))
    wave = json.loads(out.read_text())["embedded"]["0:4"]
    assert wave["tokens"] == 4 * 3
    # each prompt's second request finds its 2 full blocks (32 of 40 tokens) cached
    engine = wave["engine"]
    assert engine["prefix_cache_hit_rate"] == 2 * 32 / (4 * 40)
    assert len(engine["recent_steps"]) == engine["steps_logged"] == engine["steps"]
    summary = engine["step_ms"]
    assert summary["decode"]["steps"] + summary["prefill"]["steps"] == engine["steps"]
    # each request decodes its 2nd and 3rd tokens over contexts of 41 and 42 (in whichever steps it ran)
    assert sum(r["kv_tokens"] for r in engine["recent_steps"]) == 4 * (41 + 42)
    assert sum(r["decode"] for r in engine["recent_steps"]) == 4 * 2


@pytest.mark.slow
def test_serve_throughput_multi_turn_shape_on_cpu(tmp_path):
    out = tmp_path / "turns.json"
    _run("serve_throughput.py", "--concurrency", "2", "--prompt-len", "20",
         "--max-tokens", "3", "--turns", "3", "--turn-tokens", "5", "--output", str(out))
    result = json.loads(out.read_text())
    assert result["embedded"]["0:2"]["tokens"] == 2 * 3 * 3 and "hf_generate" not in result
    engine = result["embedded"]["0:2"]["engine"]  # how the engine thread spent the timed wave
    assert engine["steps"] >= 3 * 3 and 3 <= engine["prefill_steps"] < engine["steps"]
    assert 0 < engine["busy_frac"] <= 1.05 and engine["mean_step_ms"] > 0


@pytest.mark.slow
def test_engine_phases_on_cpu(tmp_path):
    out = tmp_path / "phases.json"
    _run("engine_phases.py", "--device", "cpu", "--shape", "group", "--concurrency", "6",
         "--prompt-len", "70", "--group-size", "3", "--max-tokens", "4", "--profile", "--output", str(out))
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"shared_prefix_on", "shared_prefix_off", "shared_prefix_on_async",
                         "shared_prefix_off_async"}
    for name, run in runs.items():
        assert run["tokens"]["generated"] == 6 * 4 and run["prefix_hit_frac"] > 0.5
        # asynchronous: sequences that end by length are not planned again, so no step is added
        assert run["steps"]["decode"]["steps"] == 3
        assert set(run["steps"]["decode"]["median_ms"]) == {"schedule", "launch", "wait",
                                                            "device", "record", "wall"}
        assert bool(run["profiles"]) != name.endswith("_async")  # the profile runs synchronously
        assert run["graph_captures"] == run["first_run"]["graph_captures"] == 0  # no CUDA graphs on CPU
        if run["profiles"]:
            assert run["profiles"]["decode"]["top_level_aten_ops"] > 0


@pytest.mark.slow
def test_decode_step_profile_on_cpu(tmp_path):
    out = tmp_path / "decode_step.json"
    proc = _run("decode_step.py", "--device", "cpu", "--batch", "3", "--prompt-len", "8", "--max-tokens", "6",
                "--unfused", "--output", str(out))
    assert "timing the gather path only" in proc.stdout
    assert "fused / own attention and MLP forwards (gather attention)" in proc.stdout
    runs = json.loads(out.read_text())["engine"]
    assert set(runs) == {"gather", "gather_unfused_layers"}
    assert runs["gather_unfused_layers"]["modules_on_own_forwards"] == 8  # 4 layers' attention and MLP
    for engine in runs.values():
        assert engine["tokens"] == 3 * 6 and engine["decode_steps"] == 5
        assert {"schedule", "step", "record", "plan", "sample_launch", "to_host"} <= set(engine["host_ms"])


@pytest.mark.slow
def test_packing_bench_runs_a_hybrid_on_cpu(tmp_path):
    """The tree-packing benchmark on a tiny Gated DeltaNet hybrid: both delta rule paths, packed
    log-probs equal to unpacked ones (float32 on CPU)."""
    out = tmp_path / "packing.json"
    _run("packing.py", "--device", "cpu", "--models", "tiny-hybrid", "--groups", "2",
         "--num-generations", "4", "--prompt-len", "24", "--min-completion", "8", "--max-completion", "80",
         "--token-budget", "256", "--warmup", "1", "--steps", "1", "--diff-samples", "4", "--out", str(out))
    result = json.loads(out.read_text())["results"][0]
    assert result["layouts"] == ["tree", "tree_torch", "padfree", "padded"]
    assert result["tree_delta_rule"] == "torch"  # no fla kernel on CPU
    assert result["tree"]["trained_tokens_per_s"] > 0 and result["speedup_vs_tree_torch"] > 0
    assert result["packing_ratio"] > 1 and result["logprob_max_abs_diff"] < 1e-4


@pytest.mark.slow
def test_delta_rule_bench_times_both_parts_and_layouts_on_cpu(tmp_path):
    """bench/delta_rule.py on small rows at the 2B head shape: the delta rule alone and a whole
    Qwen3.5 DeltaNet layer, tree and padding-free, with a profile."""
    out = tmp_path / "delta_rule.json"
    _run("delta_rule.py", "--device", "cpu", "--parts", "rule", "layer", "--groups", "2",
         "--num-generations", "3", "--prompt-len", "40", "--min-completion", "8", "--max-completion", "90",
         "--token-budget", "300", "--rows", "1", "--warmup", "0", "--repeats", "1", "--profile", "--top", "3",
         "--out", str(out))
    results = json.loads(out.read_text())["results"]
    assert {(r["layout"], r["part"]) for r in results} == {(a, b) for a in ("tree", "padfree")
                                                           for b in ("rule", "layer")}
    by_layout = {r["layout"]: r for r in results if r["part"] == "rule"}
    assert by_layout["tree"]["tokens"] < by_layout["padfree"]["tokens"] == by_layout["tree"]["sample_tokens"]
    for r in results:
        assert r["backend"] == "torch" and r["fwd_bwd_s"] > 0 and r["profile"]["kernel_ops"] > 0
        assert len(r["profile"]["by_op"]) == 3


@pytest.mark.slow
def test_lora_sync_bench_compares_merged_and_adapter_sync_on_cpu(tmp_path):
    """bench/lora_sync.py --shape tiny: both syncs ran through the trainer's paths, and the adapter
    generation really went through the adapter (its tokens differ from the base model's)."""
    out = tmp_path / "lora.json"
    _run("lora_sync.py", "--shape", "tiny", "--concurrency", "2", "--max-tokens", "8",
         "--syncs", "2", "--reps", "1", "--output", str(out))
    result = json.loads(out.read_text())
    assert (result["status"] == "complete"
            and result["command"].startswith("python bench/lora_sync.py --shape tiny"))
    side, meta = result["embedded"], result["meta"]
    assert side["generation"]["identical_outputs"] == 0
    assert (side["generation"]["base"]["tokens_per_s"] > 0
            and side["generation"]["adapter"]["tokens_per_s"] > 0)
    assert (side["generation_without_lora"]["base"]["tokens_per_s"] > 0
            and "adapter" not in side["generation_without_lora"])
    assert len(side["adapter_sync"]["syncs"]) == 2 and len(side["merged_sync"]["syncs"]) == 2
    # float32 on CPU: the merged sync carries every served weight, the adapter sync its A and B
    # (+ config, header)
    assert side["merged_sync"]["bytes"] == 4 * meta["params"] and side["merged_sync"]["transport"] == "gloo"
    adapter_bytes = side["adapter_sync"]["bytes"]
    assert 4 * meta["adapter_params"] < adapter_bytes < 4 * meta["adapter_params"] + 64 * 1024
    assert side["bytes_merged_over_adapter"] == side["merged_sync"]["bytes"] / adapter_bytes


@pytest.mark.slow
def test_lora_sync_bench_writes_partial_results_when_phases_run_out_of_time(tmp_path):
    out = tmp_path / "lora.json"
    _run("lora_sync.py", "--shape", "tiny", "--concurrency", "2", "--max-tokens", "4",
         "--phase-timeout-s", "0", "--output", str(out))
    result = json.loads(out.read_text())
    assert result["status"].startswith("cut by --phase-timeout-s: embedded/generation_without_lora")
    side = result["embedded"]
    assert side["adapter_sync"] == {"timed_out": True, "phase_s": side["adapter_sync"]["phase_s"]}
    assert side["merged_sync"]["timed_out"] and "median" not in side["merged_sync"]
    assert "bytes_merged_over_adapter" not in side


@pytest.mark.slow
def test_packing_bench_runs_both_workloads_and_step_variants_on_cpu(tmp_path):
    """Both workloads in one run, the base layouts plus the fused-head and no-checkpointing variants
    on tree and padfree, each variant's log-probs equal to the base path's."""
    out = tmp_path / "packing.json"
    _run("packing.py", "--device", "cpu", "--models", "tiny", "--workloads", "default", "shared-prompt",
         "--variants", "head+nockpt", "head", "--warmup", "1", "--steps", "1", "--diff-samples", "4",
         "--out", str(out))
    results = json.loads(out.read_text())["results"]
    assert [(r["workload"], r["shape"]) for r in results] == [("default", "tiny"), ("shared-prompt", "tiny")]
    default, shared = results
    assert 1.2 < default["packing_ratio"] < 1.8 and 3.0 < shared["packing_ratio"] < 4.0
    for r in results:
        assert set(r["variants"]) == {"head+nockpt", "head"}
        for entries in r["variants"].values():
            assert entries["speedup_vs_padfree"] > 0
            for layout in ("tree", "padfree"):
                assert entries[layout]["logprob_max_abs_diff_vs_base"] < 1e-5
        assert r["logprob_max_abs_diff"] < 1e-4 and r["tree"]["mfu"] > 0


def test_the_vllm_response_cost_bench_says_what_it_needs_without_vllm():
    proc = subprocess.run([sys.executable, str(BENCH / "vllm_response_cost.py"), "--repeats", "1"],
                          check=False,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode != 0
    assert "vLLM's source or one of its pure-Python dependencies is missing" in proc.stderr


@pytest.mark.slow
def test_weight_sync_bench_pushes_into_two_servers_and_checks_both(tmp_path):
    out = tmp_path / "sync.json"
    _run("weight_sync.py", "--servers", "2", "--syncs", "2", "--output", str(out))
    result = json.loads(out.read_text())
    assert result["meta"]["servers"] == 2 and result["checksum"]["ok"], result["checksum"]
    assert result["checksum"]["server_version"] == "v3"  # one warm-up sync, then two
    for sync in result["syncs"]:
        assert {"total_s/0", "total_s/1"} <= set(sync) and sync["bytes"] > 0
