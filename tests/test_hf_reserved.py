"""The reserved peak of a Hugging Face model planned with the trace front end (planner/module_plan.py
`analytic_twins`, `pair_reserved`): the trace's allocated peak plus the cached-but-free bytes of the
analytic front end's allocator replay of the same run, where the analytic front end reads the config and
the two allocated peaks agree; the 10% margin otherwise, and the notes say which.

Checked against allocation traces that CPU probes of the transformers models themselves recorded
(benchmarks/alloc_hf.py, tests/data/alloc_events_cpu_hf.json.gz: Llama, Qwen2 tied, GPT-2 with dropout;
8 layers, width 1024, 2 x 256 tokens, fp32, rank 0 of 8 on the fake process group), replayed through the
same allocator model as the planner's."""

from __future__ import annotations

import gzip
import json
import statistics
from math import prod
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from distplan.planner.allocator import comm_streams, replay  # noqa: E402
from distplan.planner.config import Cluster  # noqa: E402
from distplan.planner.module_plan import (ModuleDesc, ModuleModel, ModuleTrain, _regime, analytic_twins,  # noqa: E402
                                          estimate_module_memory, module_spec_plan, pair_reserved)
from distplan.planner.strategies import get_strategy  # noqa: E402
from distplan.planner.workload.trace import profile  # noqa: E402
from distplan.planner.workload.traced_model import HFWorkload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "hf"
MiB = 2**20


def _recorded_reserved(events: list, family: str) -> int:
    # as tests/test_alloc_trace.py: FSDP's buffers on the streams of the collectives that touch them
    return replay(comm_streams(events, family) if family in ("fsdp1", "fsdp2") else events).peak_reserved


def _recorded_cases(name: str, tmp_path):
    """(probe id, its recorded events, Strategy, train settings, config path, HFWorkload) of each recorded CPU
    probe of tests/data/`name` (benchmarks/alloc_hf.py), its config.json written to `tmp_path`."""
    with gzip.open(ROOT / "tests" / "data" / name, "rt") as f:
        doc = json.load(f)
    for pid, events in doc["events"].items():
        case = doc["specs"][pid]
        t = case["train"]
        cfg = tmp_path / f"{case.get('model_type') or pid.split('/')[0]}.json"
        cfg.write_text(json.dumps(case["config"]))
        yield pid, events, get_strategy(case["strategy"]), t, cfg, HFWorkload(str(cfg), t["micro_batch"],
                                                                              t["seq_len"], None)


CLUSTER = Cluster(gpus=8, gpus_per_node=8, gpu_memory_bytes=10**15, gpu_name="h100-sxm", nics_per_node=8)


def test_trace_reserved_against_recorded_hf_traces(tmp_path):
    cluster = CLUSTER
    descs: dict = {}
    errs, margin_errs = {}, {}
    for pid, events, st, t, cfg, work in _recorded_cases("alloc_events_cpu_hf.json.gz", tmp_path):
        regime = _regime(t["precision"], st.family)
        if (cfg, regime) not in descs:
            descs[cfg, regime] = ModuleDesc.from_profile(profile(work, regime))
        desc = descs[cfg, regime]
        model = ModuleModel(desc.name, work.label, desc.param_count(), desc.units, layers=len(desc.units))
        train = ModuleTrain(model, precision=t["precision"], input_shape=work.input_shape, seq_len=t["seq_len"])
        mem = estimate_module_memory(desc, train, cluster, st, device="cpu", backend="fake")
        twin, why = analytic_twins({"hf_config": str(cfg), "seq_len": t["seq_len"], "micro_batch": t["micro_batch"],
                                    "precision": t["precision"]}, cluster, "cpu", "fake", "device")
        assert why is None
        assert pair_reserved(mem, twin(st.name, t["micro_batch"])), pid
        assert mem.reserved_source == "allocator replay of the analytic front end"
        recorded = _recorded_reserved(events, st.family)
        errs[pid] = round(100 * (mem.peak_reserved / recorded - 1), 1)
        margin_errs[pid] = round(100 * (1.1 * mem.peak_allocated / recorded - 1), 1)
    print("paired:", errs, "\nmargin:", margin_errs)
    assert len(errs) == 12
    # measured 2026-11-24 (torch 2.13 CPU, 12 probes): paired -2.9%..+3.1%, median |error| 1.7%; the 10% margin
    # it replaces: -22.5%..+7.3%, median 12.4% (FSDP's comm buffers on their own streams reserve far more).
    # 2026-12-01, with the trace writing the tied LM head's construction transient, the tied gradients at the
    # embedding's backward (every strategy), gelu_new's five saved MLP tensors and FSDP1's construction order,
    # each as the recorded traces show them: -3.3%..+3.4%, median 2.15% (gpt2 ddp +1.9 -> -1.0, fsdp -1.4 ->
    # +1.4; qwen2 zero2 +1.0 -> +3.4, zero3 -0.9 -> +3.2; llama fsdp -2.9 -> -3.3): at this vocabulary (8,192)
    # the tied tensors are small; at Qwen2.5-0.5B's they were -11% to -12% (tests/test_alloc_trace.py)
    assert statistics.median(abs(e) for e in errs.values()) <= 3.0, errs
    assert max(abs(e) for e in errs.values()) <= 5.0, errs
    assert statistics.median(abs(e) for e in errs.values()) < statistics.median(abs(e) for e in margin_errs.values())


def _case_init(name: str) -> dict:
    """pid -> how the recorded probe built the model ("device", or "meta": on the meta device, wrapped there)."""
    with gzip.open(ROOT / "tests" / "data" / name, "rt") as f:
        return {pid: case.get("init", "device") for pid, case in json.load(f)["specs"].items()}


def _own_replays(name: str, tmp_path) -> dict:
    """pid -> (reserved error %, allocated error %) of the trace front end's own written run
    (module_plan.logged_module_events over the traced step's allocation log, expanded from 4 traced layers)
    against each recorded CPU probe of tests/data/`name` (benchmarks/alloc_hf.py)."""
    from distplan.planner.config import checkpoint_every
    from distplan.planner.module_plan import _shard_group, _traced, logged_module_events
    errs = {}
    init = _case_init(name)
    for pid, events, st, t, _, work in _recorded_cases(name, tmp_path):
        every = checkpoint_every(t["checkpointing"])
        desc = _traced(work, _regime(t["precision"], st.family), "cpu", every)  # 8 layers from 4 traced
        assert desc.alloc_log and desc.alloc_log_every == every, pid
        model = ModuleModel(desc.name, work.label, desc.param_count(), desc.units, layers=len(desc.units))
        train = ModuleTrain(model, precision=t["precision"], input_shape=work.input_shape, seq_len=t["seq_len"],
                            checkpointing=t["checkpointing"])
        written = logged_module_events(desc, train, st.family, 8, _shard_group(st, CLUSTER)[1], strategy=st.name,
                                       init=init[pid])
        assert written is not None, pid
        errs[pid] = _against_recorded(list(written), events, st.family)
    print(errs)
    return errs


def _against_recorded(written: list, events: list, family: str) -> tuple:
    """(reserved error %, allocated error %) of the written events' replay against the recorded ones'."""
    w, r = replay(written), replay(comm_streams(events, family) if family in ("fsdp1", "fsdp2")
                                   else [e for e in events if e[0] != "comm"])
    return (round(100 * (w.peak_reserved / r.peak_reserved - 1), 1),
            round(100 * (w.peak_allocated / r.peak_allocated - 1), 2))


def test_trace_own_replay_against_recorded_hf_traces(tmp_path):
    """The reserved peak `estimate --hf-config` prints for a GPU for an untied model (module_plan.
    estimate_module_memory with the trace's own events; a tied one pairs first, see below): the traced step's
    allocations, FSDP's and DDP's buffers written between them at the hooks the trace marked, replayed. Against the 12 recorded probes above (Llama, Qwen2 tied, GPT-2 with
    dropout under ddp, zero2, zero3, fsdp). Measured 2026-12-02 (torch 2.13 CPU): the reserved peak to the byte
    in 4, within 1.6% in all (median 0.85%; ddp +1.3% to +1.6%); the allocated peak within 0.7%. Then, with
    DDP's construction broadcast written as `broadcast_coalesced` runs it (buckets of at least 250 MiB, two in
    flight; alloc_trace._broadcast_coalesced), where it had been 250 MiB chunks one at a time: ddp +1.3% ->
    0.0% (llama), -0.2% (qwen2), -0.8% (gpt2); within 1.5% in all. The analytic front end's pairing (above) had read -3.3% to +3.4%, median 2.15%."""
    errs = _own_replays("alloc_events_cpu_hf.json.gz", tmp_path)
    assert len(errs) == 12
    assert statistics.median(abs(r) for r, _ in errs.values()) <= 1.0, errs
    assert max(abs(r) for r, _ in errs.values()) <= 2.0, errs
    assert max(abs(a) for _, a in errs.values()) <= 1.0, errs


def test_trace_own_replay_of_model_types_only_the_trace_reads(tmp_path):
    """Mixtral (4 experts, top-2: each expert's 3-D weight has 4 rows for 8 ranks, so FSDP2 all-gathers and
    copies out its padding too) and OLMo-2 (q/k norms over the width), which the analytic front end does not
    read: before this their reserved peak was the allocated peak + 10%. Recorded CPU probes
    (tests/data/alloc_events_cpu_hf_traced.json.gz; 8 layers, 2 x 256 tokens, fp32, rank 0 of 8; ddp, zero2,
    zero3, fsdp). Measured 2026-12-02: the reserved peak to the byte in 7 of 8, +0.4% (OLMo-2 ddp) in the other,
    then in all 8 with DDP's construction broadcast as `broadcast_coalesced` runs it; the allocated peak within
    0.5%."""
    errs = _own_replays("alloc_events_cpu_hf_traced.json.gz", tmp_path)
    assert len(errs) == 8
    assert all(r == 0 for r, _ in errs.values()), errs
    assert max(abs(a) for _, a in errs.values()) <= 0.5, errs


def test_trace_own_replay_under_transformers_checkpointing(tmp_path):
    """transformers' own full activation checkpointing (`activation_checkpointing_enable`, non-reentrant):
    the trace runs it too, so its log has every layer's recomputation where backward runs it. Llama and
    Mixtral, recorded as above (tests/data/alloc_events_cpu_hf_ckpt.json.gz; measured reserved / allocated up
    to 1.85, which the 10% margin would have read 41% under). Measured 2026-12-02: the reserved peak to the
    byte in 7 of 8, +1.0% (Llama ddp, as above) in the other, then in all 8 (DDP's broadcast, as above); the
    allocated peak within 0.4%."""
    errs = _own_replays("alloc_events_cpu_hf_ckpt.json.gz", tmp_path)
    assert len(errs) == 8
    assert all(r == 0 for r, _ in errs.values()), errs
    assert max(abs(a) for _, a in errs.values()) <= 0.5, errs


def _analytic_replays(name: str, tmp_path, only: tuple = ()) -> dict:
    """pid -> (reserved error %, allocated error %) of the analytic front end's written run of the same config
    and run (alloc_trace.allocation_events through analytic_twins) against each recorded probe of `name` (or
    those named in `only`)."""
    from distplan.planner.alloc_trace import allocation_events
    errs = {}
    init = _case_init(name)
    for pid, events, st, t, cfg, _ in _recorded_cases(name, tmp_path):
        if only and pid not in only:
            continue
        twin, why = analytic_twins({"hf_config": str(cfg), "seq_len": t["seq_len"], "micro_batch": t["micro_batch"],
                                    "precision": t["precision"], "activation_checkpointing": t["checkpointing"]},
                                   CLUSTER, "cpu", "fake", init[pid])
        assert why is None, pid
        args = twin(st.name, t["micro_batch"]).reserved_replay
        errs[pid] = _against_recorded(allocation_events(*args[:7], init=args[8]), events, st.family)
    print(errs)
    return errs


def test_trace_own_replay_at_a_real_vocabularys_proportions_built_on_device_and_on_meta(tmp_path):
    """Qwen2.5-7B's proportions at 2/7 of its width (vocabulary 43,392 untied, 1 x 1024 tokens, 8 layers: the
    vocabulary-sized tensors weigh against a block as at Qwen2.5-7B's 4096 tokens), with and without full
    checkpointing, ddp/zero1/zero2/zero3/fsdp built on the device and zero2/zero3/fsdp built on the meta device
    and wrapped there, as `estimate --hf-config` plans them (validate/wrap.py `materialize`;
    tests/data/alloc_events_cpu_hf_vocab.json.gz). At Qwen2.5-7B's real size (16 GPUs, 4096 tokens, meta) the
    trace's writer and the analytic one read -17.5% to +11.4% apart in the reserved peak; this scale
    reproduced it (zero3 with full checkpointing: the trace's +13.7% over the analytic one). Measured
    2026-12-02 (torch 2.13 CPU): the trace's own run exact in all 12 FSDP probes and both ZeRO-1 ones, reserved
    and allocated (DDP: -0.3%, and -2.6% with checkpointing, where a run of frees is put in allocation order,
    module_probe._frees_in_order, and the recording frees the MLP's output first); the analytic writer's
    allocated peak -3.0% (zero3), -3.1% (fsdp), +5.9% (zero3 full), its reserved peak +4.3% (zero1) and -12.1%
    (zero3 full on meta): the trace is right (the plan prints the own replay for an untied model). 2026-12-04:
    the analytic writer's zero3 and fsdp allocated peaks -3.0% / -3.1% -> +0.2% / +0.1% (on meta +0.2% / +0.1%)
    with the root's pre-backward prefetch of the last block written: the recorded runs all-gather it as the
    backward begins, before the loss's and the head's n x V tensors (alloc_trace.allocation_events)."""
    own = _own_replays("alloc_events_cpu_hf_vocab.json.gz", tmp_path)
    assert len(own) == 16
    assert all(r == 0 and abs(a) < 0.05 for pid, (r, a) in own.items() if not pid.endswith("/ddp")), own
    assert max(abs(r) for r, _ in own.values()) <= 3.0, own
    analytic = _analytic_replays("alloc_events_cpu_hf_vocab.json.gz", tmp_path)
    # 2026-12-04, the analytic writer's forward op by op (alloc_trace.block_program: each block's intermediates
    # made and dropped as the modeling code does, a checkpointed block's no-grad forward no longer one burst of
    # its saved tensors, the embedding's output block 0's input rather than a tensor of its own): zero3 on meta
    # with full checkpointing -12.3% -> 0.0% (the burst had left free segments that took the embedding's
    # optimizer states, so the recorded run's second 339 MiB segment never came); the allocated peaks exact but
    # for the non-checkpointed ddp (+0.24%). ZeRO-1 without checkpointing moved -0.2% -> -4.4%: the first
    # place its written run and the recorded one part is the final norm's backward, which the writer leaves out
    # (the head input's gradient and the norm's n x h intermediates).
    #
    # 2026-12-06, the event list's residual-stream gradient carried from the head's backward to the embedding's
    # (one tensor, as autograd's InputBuffer keeps it; it had been freed with each block's transients), FSDP2's
    # last unsharded gradient freed after the reduce-scatter output is allocated (config.
    # fsdp2_reduce_keeps_last_grad, which the walk counted and the writer did not) and the embedding output no
    # longer counted twice: every allocated peak unchanged, every reserved peak but one unchanged. That one,
    # zero3 on meta with full checkpointing, 0.0% -> -14.2% (REPLAY_GAP): the same allocations land in other
    # free blocks, so the root's 339 MiB reduce-scatter input of the last step finds one where the recording
    # needs a new segment. Read side by side, the two event lists first part where the writer leaves out the
    # final norm's backward (its n x h intermediates) and writes a checkpointed block's recomputation and
    # backward in another order (the recording makes six n x f tensors before its first free there, the writer
    # four); before, with the residual gradient freed at each block's end, the blocks landed as recorded.
    # Later that day the final norm's backward was written op by op (train_step_trace.final_norm_backward): the
    # written events of that run now follow the recorded ones to the last block's recomputed backward (every one
    # of >= 4 MB in order but the head's two gradients, made weight first there), where they still part; its
    # reserved peak unchanged.
    gap = {pid: analytic.pop(pid) for pid in REPLAY_GAP}
    assert all(abs(r) <= 1.0 for pid, (r, _) in analytic.items() if not pid.endswith("/zero1")), analytic
    assert max(abs(r) for r, _ in analytic.values()) <= 5.0, analytic
    assert max(abs(a) for _, a in {**analytic, **gap}.values()) <= 0.3, gap
    prefetched = [f"qwen2-vocab{m}/{s}" for m in ("", "-meta") for s in ("zero3", "fsdp")]
    assert all(abs(analytic[i][1]) <= 0.5 for i in prefetched), {i: analytic[i] for i in prefetched}


REPLAY_GAP = ("qwen2-vocab-meta-full/zero3",)
"""Recorded runs whose reserved peak the analytic writer's replay misses by more than 1% (see the test above)."""


@pytest.mark.xfail(strict=True, reason="the analytic writer's replay of zero3 on meta with full checkpointing is "
                                       "14.2% low: a recomputed block's backward is written in another order "
                                       "than the recording's")
def test_analytic_replay_of_the_known_gap(tmp_path):
    analytic = _analytic_replays("alloc_events_cpu_hf_vocab.json.gz", tmp_path, only=REPLAY_GAP)
    assert all(abs(r) <= 1.0 for r, _ in analytic.values()), analytic


@pytest.mark.slow
@pytest.mark.newest
def test_tied_models_pair_with_the_analytic_replay(tmp_path):
    """Tied embeddings (Qwen2 at vocabulary 32k, Qwen2.5-0.5B at its real 151,936; bf16-mixed; the recorded
    probes of tests/test_alloc_trace.py): the module writers do not write the LM head transformers makes and
    drops, nor the tied weight's gradients at the embedding's backward, and their own run reads -11.1% to
    +8.2% (measured 2026-12-02; allocated -19% under FSDP at the real vocabulary), where the analytic writer,
    which writes both, reads within 0.7%. So a tied model's plan pairs with the analytic replay
    (module_plan.pair_tied)."""
    errs = _own_replays("alloc_events_cpu_tied_bf16.json.gz", tmp_path)
    assert len(errs) == 8
    assert max(abs(r) for r, _ in errs.values()) > 5.0, errs  # why the pairing comes first
    p = _plan(EXAMPLES / "llama-tied-vocab64k-4l.json")
    assert all(r.memory.reserved_source == "allocator replay of the analytic front end" for r in p.results), \
        [(r.name, r.memory.reserved_source) for r in p.results]


def test_trace_plan_of_a_model_type_only_the_trace_reads_replays_its_own_run():
    p = _plan(EXAMPLES / "mixtral-8l.json")
    assert all(r.memory.reserved_source == "allocator replay" for r in p.results), \
        [(r.name, r.memory.reserved_source) for r in p.results]
    assert any(n.startswith("reserved peak: the traced step's own allocations") and "margin" not in n
               for n in p.notes), p.notes


def _plan(config, **kw):
    return module_spec_plan(dict(dict(hf_config=str(config), gpus=8, gpu="h100-sxm", seq_len=256, micro_batch=1,
                                      precision="bf16-mixed", detect_local=False), **kw),
                            ("ddp", "zero2", "zero3", "fsdp"))


@pytest.fixture
def unwritten_every_k(monkeypatch):
    """Checkpointed allocation logs that cannot be expanded (`module_probe._periodic_log` finding the traced
    layers unlike): the plan must then say what it falls back to. Traces of this test are its own."""
    from distplan.planner import module_plan
    from distplan.planner.workload import trace as module_probe

    real = module_probe._periodic_log

    def without_log(*args, **kwargs):
        out = real(*args, **kwargs)
        out.pop("alloc_log", None)
        return out
    monkeypatch.setattr(module_probe, "_periodic_log", without_log)
    monkeypatch.setattr(module_plan, "_TRACES", {})


@pytest.mark.slow
@pytest.mark.newest
def test_trace_plan_replays_its_own_run_and_pairs_where_that_is_not_written(unwritten_every_k):
    p = _plan(EXAMPLES / "llama-8l.json")
    assert all(r.memory.reserved_source == "allocator replay" for r in p.results)
    assert any(n == "reserved peak: the traced step's own allocations replayed through the caching allocator for "
               "ddp, zero2, zero3, fsdp" for n in p.notes), p.notes
    # checkpointing every 2nd layer, its log not expanded (the fixture): the run is not written from it,
    # paired with the analytic replay
    p = _plan(EXAMPLES / "llama-8l.json", activation_checkpointing="every-2")
    assert any(n.startswith("reserved peak: the trace's allocated peak plus") and "margin" not in n
               for n in p.notes), p.notes
    for r in p.results:
        m = r.memory
        a = p.twin(r.name, 1)
        assert m.reserved_source == "allocator replay of the analytic front end", r.name
        assert a.reserved_source == "allocator replay"
        # the same cached-but-free bytes on top of the trace's own allocated peak, in whole 2 MiB segments
        assert m.peak_reserved % (2 * MiB) == 0
        assert abs((m.peak_reserved - m.peak_allocated) - (a.peak_reserved - a.peak_allocated)) <= 2 * MiB
        assert m.peak_reserved >= m.peak_allocated
    # FSDP's communication buffers on their own streams: far more cached than the margin would say
    zero3 = next(r for r in p.results if r.name == "zero3").memory
    assert zero3.peak_reserved > 1.1 * zero3.peak_allocated


@pytest.mark.slow
@pytest.mark.newest
def test_every_k_trace_replays_its_own_run():
    """Every-2 on an 8-layer model: its allocation log traced at 6 layers and a period of 2 repeated
    (module_probe.periodic_trace_layers), so the plan replays the traced run's own allocations, as without
    checkpointing, for a model the formulas read (Llama) and one they do not (OLMo-2)."""
    for config in ("llama-8l.json", "olmo2-8l.json"):
        p = _plan(EXAMPLES / config, activation_checkpointing="every-2")
        assert all(r.memory.reserved_source == "allocator replay" for r in p.results), \
            (config, [(r.name, r.memory.reserved_source) for r in p.results])
        for r in p.results:
            assert r.memory.peak_reserved % (2 * MiB) == 0 and r.memory.peak_reserved >= r.memory.peak_allocated


@pytest.mark.slow
@pytest.mark.newest
def test_trace_keeps_the_margin_where_neither_replay_is_written(unwritten_every_k):
    # q/k norms over the whole width: a model_type only the trace plans; every-2, its log not expanded
    p = _plan(EXAMPLES / "olmo2-8l.json", activation_checkpointing="every-2")
    assert all(r.memory.reserved_source == "10% margin" for r in p.results)
    assert any("10% margin for ddp, zero2, zero3, fsdp: not written from the trace, nor paired: this model_type"
               in n and "llama" in n
               for n in p.notes), p.notes
    # no analytic twin: the step time is the traced kernels', and the plan says so
    assert any(n.startswith("step time: every kernel the traced step launched") for n in p.notes), p.notes
    # Gemma-2: the formulas read it (sandwich norms, soft-capped eager attention), so the trace pairs with them
    p = _plan(EXAMPLES / "gemma2-8l.json", activation_checkpointing="every-2")
    assert not any(n.startswith("step time: every kernel the traced") for n in p.notes), p.notes
    assert all(r.memory.reserved_source == "allocator replay of the analytic front end" for r in p.results), \
        [(r.name, r.memory.reserved_source) for r in p.results]
    # every-K: the formulas plan it (blocks 0, K, 2K, ... keep their input), so the trace pairs with them
    p = _plan(EXAMPLES / "llama-8l.json", activation_checkpointing="every-2")
    assert all(r.memory.reserved_source == "allocator replay of the analytic front end" for r in p.results), \
        [(r.name, r.memory.reserved_source) for r in p.results]


@pytest.mark.parametrize("cfg, precision", [
    ("gpt2-8l.json", "fp32"),
    # gelu_new under CUDA's autocast: torch.pow in fp32 (autocast_mode.h AT_FORALL_FP32), the rest of the GELU
    # promoted to fp32 (kernel_rules.gelu_new_elem_bytes): DDP's peak had read 251,260,928 B by the formulas
    # against 263,108,612 B traced (-4.5%) while the formulas followed the CPU's lists
    ("gpt2-8l.json", "bf16-mixed"),
    ("llama-8l.json", "fp32"),
])
def test_the_plan_traces_what_cudas_kernels_keep(cfg, precision):
    """The trace runs on the CPU, but a plan is for GPUs: where CPU and CUDA kernels keep different tensors
    (GPT-2's attention dropout sends the CPU's SDPA to its math composite, which keeps the probabilities;
    CUDA's fused kernels do not; fp32 with grouped KV heads runs CUDA's math composite, which keeps them;
    dropout's mask is a bool on CUDA), the plan's trace keeps CUDA's (module_probe `_cuda_kernels`), and
    agrees with the analytic front end's CUDA formulas (activations.py), which read the same choices from
    sdp_utils.cpp, so the reserved peak pairs; the CPU probes' own prediction keeps the CPU's kernels."""
    p = _plan(EXAMPLES / cfg, precision=precision)
    twin, _ = analytic_twins({"hf_config": str(EXAMPLES / cfg), "seq_len": 256, "micro_batch": 1,
                              "precision": precision}, p.cluster)
    for r in p.results:
        a = twin(r.name, 1).peak_allocated
        assert r.memory.peak_allocated == pytest.approx(a, rel=2e-4), (cfg, precision, r.name)
        # (GPT-2 ties its embeddings: paired, module_plan.pair_tied)
        assert r.memory.reserved_source == ("allocator replay of the analytic front end" if cfg.startswith("gpt2")
                                            else "allocator replay"), (cfg, r.name)
    assert not any("kernels keep" in n for n in p.notes), p.notes


@pytest.mark.slow
def test_real_width_fp32_math_attention_pairs_with_the_formulas():
    """At real width, where CUDA's fp32 math composite makes the softmax's backward the block's peak under
    FSDP (Mistral-7B's blocks, 2 x 1024 tokens; memory._block_backward_peak): within 0.5%, so it pairs
    (the formulas were 5.6% above the trace before they freed the MLP's saved tensors there)."""
    cfg = ROOT / "tests" / "data" / "hf" / "mistral-7b.json"
    kw = dict(hf_config=str(cfg), layers=4, seq_len=1024, micro_batch=2, precision="fp32")
    p = module_spec_plan(dict(kw, gpus=8, gpu="h100-sxm", detect_local=False), ("zero3", "fsdp", "ddp"))
    twin, _ = analytic_twins(kw, p.cluster)
    for r in p.results:
        assert r.memory.peak_allocated == pytest.approx(twin(r.name, 2).peak_allocated, rel=5e-3), r.name
        assert r.memory.reserved_source == "allocator replay", r.name  # the trace's own, not the pairing
    # the CPU's kernels keep other bytes: the trace of each device differs by what the formulas say
    from distplan.planner.activations import activations_in
    from distplan.planner.api import resolve_model
    from distplan.planner.config import TrainConfig
    for cfg, dtype, regime in (("gpt2-8l.json", "float32", "fp32"), ("llama-8l.json", "float32", "fp32")):
        work = HFWorkload(str(EXAMPLES / cfg), 1, 512, None)
        cpu, cuda = profile(work, dtype), profile(work, dtype, "cuda")
        spec, _ = resolve_model(hf_config=str(EXAMPLES / cfg))
        t = TrainConfig(spec, seq_len=512, micro_batch=1, precision="fp32")
        formulas = activations_in(t, regime, "cuda").total - activations_in(t, regime, "cpu").total
        assert cuda["activation_bytes"] - cpu["activation_bytes"] == formulas != 0, cfg
        assert cuda["kernels_of"] == "cuda" and cpu["kernels_of"] == "cpu"


def test_root_gradient_of_the_last_block_segment(tmp_path):
    """The LM head's gradient is made in the last block's segment (the root's ops after the unit join it)
    and lives until the root reduces at the end of backward. At a long sequence in 16-bit the segment's
    highest instant before its hook comes before AccumulateGrad has taken it (it is autograd's transient
    then), so the walk reads it from the gradients the segment made (the profile's `grads_made`): every
    earlier block's instants carry it."""
    cfg = json.loads((EXAMPLES / "llama-8l.json").read_text())
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(cfg))
    desc = ModuleDesc.from_profile(profile(HFWorkload(str(path), 1, 2048, None), "bfloat16"))
    last = desc.segments[-2]
    own = sum(prod(s) for s in desc.unit_shapes(last[0])) * 2
    head = cfg["vocab_size"] * cfg["hidden_size"] * 2
    norm = cfg["hidden_size"] * 2
    assert last[3][0][1] == 0  # not yet a gradient at the before-hook instant
    assert last[7] - own == head + norm  # made in the segment: the final norm's and the head's gradients
    model = ModuleModel(desc.name, "llama", desc.param_count(), desc.units, layers=len(desc.units))
    train = ModuleTrain(model, precision="bf16-mixed", input_shape=(1, 2048), seq_len=2048)
    from distplan.planner import module_plan
    cluster = Cluster(gpus=8, gpus_per_node=8, gpu_memory_bytes=10**15, gpu_name="h100-sxm", nics_per_node=8)
    module_plan._TRACE_SNAPSHOTS = []
    try:
        estimate_module_memory(desc, train, cluster, get_strategy("zero3"), device="cpu", backend="fake")
        snaps = module_plan._TRACE_SNAPSHOTS
    finally:
        module_plan._TRACE_SNAPSHOTS = None
    # the instants of the blocks before the last, up to the root's reduce: the head's gradient in each
    backward = [s for s in snaps if s.phase == "backward"]
    assert min(s.parts["grads"] for s in backward[4:-3]) >= head + norm


def test_gpu_probe_prediction_judges_reserved_where_replayed(unwritten_every_k):
    """`distplan validate --hf-config` on a GPU judges max_memory_reserved against the trace's own replay, for
    a model the analytic front end reads and one it does not; where neither replay is written (an
    OLMo-2 checkpointing every 2nd layer, its log not expanded: the fixture) it gets no reserved prediction (a
    margin is not one), nor does a CPU probe."""
    from distplan.planner.module_prediction import predict_module_probe

    def predicted(config, device_type, checkpointing="none"):
        spec = {"strategy": "zero3", "world_size": 8, "gpus_per_node": 8, "mode": "fake", "device_type": device_type,
                "train": {"seq_len": 256, "micro_batch": 2, "precision": "bf16-mixed", "checkpointing": checkpointing},
                "module": {"hf_config": str(EXAMPLES / config), "micro_batch": 2, "seq_len": 256, "layers": None}}
        return predict_module_probe(spec)["memory"]

    for config in ("llama-8l.json", "olmo2-8l.json"):
        m = predicted(config, "cuda")
        assert m["peak_reserved"] % (2 * MiB) == 0 and m["peak_reserved"] > m["peak_allocated"], config
    assert "peak_reserved" not in predicted("olmo2-8l.json", "cuda", "every-2")
    assert "peak_reserved" not in predicted("llama-8l.json", "cpu")


REAL_SIZE = (("qwen2.5-7b", "bf16-mixed", 1, {"zero3": 0.025}), ("llama-3-8b", "bf16-mixed", 1, {"zero3": 0.03}),
             ("llama-3-8b", "bf16", 2, {"zero3": 0.05}),
             ("mistral-7b", "bf16-mixed", 1, {"zero3": 0.085}))
"""Real sizes the analytic writer is judged at (model, precision, micro-batch), and its known gaps against the
trace's own run (|error| bound)."""


@pytest.mark.slow
@pytest.mark.parametrize("name,precision,micro_batch,gaps", REAL_SIZE,
                         ids=[f"{n}-{p}-mb{b}" for n, p, b, _ in REAL_SIZE])
def test_analytic_replay_at_real_size_reads_the_traces_own_run(name, precision, micro_batch, gaps):
    """At a real size (the published config, 16 GPUs on 2 nodes, 1 x 4096 tokens, bf16-mixed, full activation
    checkpointing, FSDP built on the meta device as planned), the reserved peak the analytic front end prints
    (`estimate --model`) against the one the trace's own run of the transformers model prints
    (`estimate --hf-config`; that replay is exact to the byte on the CPU recordings above). The analytic writer
    used to leave out the loss's fp32 copy of the 16-bit logits and its cast back in backward (transformers'
    ForCausalLMLoss `logits.float()`), and the head's 16-bit weight gradient under autocast: Qwen2.5-7B (a 152k
    vocabulary) read +21.3% (zero3) and +12.3% (zero2) over its own run, Llama-3-8B +9.4% (fsdp) and +5.3%
    (fsdp-grad-op). Measured 2026-12-03 with them written: within 3.2% for every strategy but ZeRO-1 (-9.2% and
    -5.1%). ZeRO-1's gap was autocast's weight cache: a checkpointed block's 16-bit weight casts stay cached until
    the autocast region exits after the loss, and the segments they leave behind fragment the backward's gradient
    allocations; written so, Qwen2.5-7B's reads -0.3% and Llama-3-8B's -3.9% (the gap this test bounds: the
    order of a block backward's own allocations, which the writer puts down as one burst). Pure bf16, built on
    the device as the probes build it (fp32, then `model.to(torch.bfloat16)`): the fp32 model's segments stay
    reserved; written without them, Llama-3-8B's ZeRO-1 at micro-batch 2 read -12.6%, now 0.0% (its zero3 reads
    +3.8%, over: the bound). A block's saved tensors written one per tensor, as activations.py counts them
    (alloc_trace._block_saved_shapes; the rest had been one tensor of up to 304 MiB, which the fp32 gradients
    reused): ZeRO-1 Llama-3-8B -3.9% -> 0.0%, Mistral-7B -6.6% -> +0.3%, Qwen2.5-7B -0.3% -> +0.1%. zero3 moved
    the other way, further over (the safe side; the bounds): Qwen2.5-7B +3.2% -> +3.7%, Llama-3-8B +3.1% ->
    +4.0%, pure bf16 +3.8% -> +5.5%, Mistral-7B +1.0% -> +9.4% (a second 1000 MiB loss segment that the
    trace's run finds room for) and its zero2 +2.3% -> +4.0%: where the checkpointed forward's burst of a
    block's saved tensors (the writer's, not an op-by-op forward) leaves its free blocks. 2026-12-04: the
    root's pre-backward prefetch of the last block written (FSDP2 and FSDP1, before the loss's backward, as the
    recorded CPU traces show) and the last all-gather output freed at the root's post-forward, after the loss:
    zero3 Qwen2.5-7B +3.7% -> +1.9%, Llama-3-8B +4.0% -> +2.3%, pure bf16 +5.5% -> +4.1%; fsdp and hsdp
    +1.1..1.5% -> 0.0%. Then a block's backward in two phases, to its peak (the consumed saved tensors freed,
    the transients, the MLP's output projection's weight gradient) and after, the recomputation beside the kept
    input: Mistral-7B zero3 +9.4% -> +0.7%, zero2 +4.0% -> -0.1% (fsdp +3.0%, the largest). The allocated peaks agree
    too: FSDP1's walk now takes the middle blocks' MLP backward (Mistral-7B fsdp: -3.6% -> 0.0%, its block 1,
    where the gradient shards of 30 blocks and the prefetched block 0 meet a recomputed block). Then the forward
    written op by op (alloc_trace.block_program: a checkpointed block's no-grad forward makes and drops its
    intermediates as the modeling code does, no burst of its saved tensors; the embedding's output is block 0's
    input, no longer a tensor of its own): zero3 Qwen2.5-7B +1.9% -> 0.0%, Llama-3-8B +2.3% -> 0.0%, fsdp
    Mistral-7B +3.0% -> 0.0%; Mistral-7B's zero3 +0.7% -> +8.0% (over: its third step makes a second 1000 MiB
    loss segment, the first one's last 250 MiB taken when the loss's backward needs it whole, where the trace's
    run puts that backward's two n x V fp32 tensors side by side in it)."""
    p = module_spec_plan(dict(hf_config=str(ROOT / "tests" / "data" / "hf" / f"{name}.json"), gpus=16,
                              gpus_per_node=8, gpu="h100", seq_len=4096, micro_batch=micro_batch,
                              precision=precision, activation_checkpointing="full", detect_local=False))
    errs = {r.name: p.twin(r.name, micro_batch).peak_reserved / r.memory.peak_reserved - 1
            for r in p.results if r.memory.reserved_source == "allocator replay"}
    allocated = {r.name: round(100 * (p.twin(r.name, micro_batch).peak_allocated / r.memory.peak_allocated - 1), 2)
                 for r in p.results}
    assert all(abs(e) <= 0.1 for e in allocated.values()), allocated
    assert {"ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"} <= set(errs), errs
    table = {k: round(100 * v, 1) for k, v in errs.items()}
    assert all(abs(e) <= gaps.get(k, 0.035) for k, e in errs.items()), table
