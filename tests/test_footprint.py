"""The device footprint beyond the caching allocator (planner/footprint.py) against figures derived by
hand from NVIDIA/nccl's source (v2.27.5-1 .. v2.30.7-1; file and function named at each figure)."""

import pytest

from distplan.planner import footprint as fp
from distplan.planner.config import Cluster, TrainConfig
from distplan.planner.memory import estimate_memory
from distplan.planner.api import resolve_model

MIB = 2**20
H100x8 = Cluster(gpus=8, gpu_name="h100-sxm", intra_link="nvlink4")
A100x8 = Cluster(gpus=8, gpu_name="a100-80gb", intra_link="nvlink3")


def comm(cluster, world=None, env=None, group="world", tp=1, version=fp.NCCL_VERSION):
    return fp.device_footprint(cluster, cluster.gpus if world is None else world, group, tp,
                               environ=env or {}, nccl_version=version)


def test_protocol_buffer_sizes_from_device_h():
    # src/include/device.h: LL 8 lines/thread x 512 threads x 8 steps x 16-byte lines;
    # LL128 120 elems/thread x 640 threads x 8 steps x 8 bytes; src/init.cc DEFAULT_BUFFSIZE 1 << 22
    assert fp.DEFAULT_LL_BUFFSIZE == 524288 == 512 * 1024
    assert fp.DEFAULT_LL128_BUFFSIZE == 4915200  # 4.6875 MiB
    assert fp.DEFAULT_BUFFSIZE == 4 * MIB


def test_h100_nvswitch_node_by_hand():
    c = comm(H100x8, version=(2, 29, 7)).nccl[0]
    # search.cc: 18 NVLinks x 20.6 GB/s (topo.h SM90_NVLINK_BW) = 370.8; first sm90 speed 60 -> 6
    # channels; connect.cc ncclTopoPostset doubles to 12. NVLS: 16 channels (nvls.cc NVLS_NCHANNELS_SM90).
    assert (c.channels, c.nvls_channels, c.channels_source, c.p2p_read) == (12, 16, "derived", False)
    # p2p.cc: receiver 4096 + 512 KiB + 4.6875 MiB + 4 MiB = 9,637,888 B -> 10 MiB (CUDA_IPC_MIN);
    # sender 4096 B -> 2 MiB. One send and one receive per channel on the ring.
    assert c.ring == 12 * (10 + 2) * MIB
    # nvls.cc ncclNvlsBufferSetup: 16 channels x 2 x (128 KiB x 8 steps) x 8 heads = 256 MiB, credits one
    # 2 MiB granule, one nvlsDevPeers granule per NVLS channel.
    assert c.nvls == 256 * MIB + 2 * MIB + 16 * 2 * MIB
    # channel.cc initChannel: 3 cuMem granules per channel, 16 channels initialised (pow2Up(12) for p2p,
    # and the 16 NVLS channels); init.cc devCommSetup: 2 granules.
    assert c.channel_structs == 16 * 3 * 2 * MIB and c.dev_comm == 4 * MIB
    assert c.total == (144 + 290 + 96 + 4) * MIB
    assert comm(H100x8).total == fp.CUDA_CONTEXT_BYTES + comm(H100x8).nccl[0].total
    # NCCL 2.27 (connect.cc, removed in 2.28) raised the ring to the 16 NVLS channels: 4 more ring channels.
    old = comm(H100x8, version=(2, 27, 5)).nccl[0]
    assert old.channels == 16 and old.ring == 16 * 12 * MIB and old.total == c.total + 4 * 12 * MIB


def test_nvls_enable_zero_drops_nvls():
    on = comm(H100x8).nccl[0]
    off = comm(H100x8, env={"NCCL_NVLS_ENABLE": "0"}).nccl[0]
    assert (off.channels, off.nvls_channels, off.nvls) == (12, 0, 0)
    assert off.ring == 12 * 12 * MIB
    # paths.cc ncclTopoComputeP2pChannels initialises pow2Up(12) = 16 channels either way.
    assert off.channel_structs == on.channel_structs == 16 * 3 * 2 * MIB
    assert on.total - off.total == on.nvls == 290 * MIB
    old_on, old_off = (comm(H100x8, env=e, version=(2, 27, 5)).nccl[0] for e in ({}, {"NCCL_NVLS_ENABLE": "0"}))
    assert old_on.total - old_off.total == on.nvls + 4 * 12 * MIB  # and the raise of the ring to 16


def test_buffsize_and_ll128_env():
    big = comm(H100x8, env={"NCCL_BUFFSIZE": str(8 * MIB)}).nccl[0]
    # receiver 4096 + 524288 + 4915200 + 8 MiB = 13,832,192 B -> 14 MiB
    assert big.ring == 12 * (14 + 2) * MIB
    small = comm(H100x8, env={"NCCL_BUFFSIZE": "1048576", "NCCL_LL128_BUFFSIZE": "0"}).nccl[0]
    assert small.ring == 12 * (2 + 2) * MIB  # 4096 + 512 KiB + 1 MiB -> 2 MiB
    with pytest.raises(ValueError, match="NCCL_BUFFSIZE"):
        comm(H100x8, env={"NCCL_BUFFSIZE": "4MB"})


def test_nccl_proto_changes_nothing():
    # computeBuffSizes allocates all three protocols' buffers whatever NCCL_PROTO says.
    assert comm(H100x8, env={"NCCL_PROTO": "Simple"}).total == comm(H100x8).total


def test_channel_env_limits():
    # connect.cc: NCCL_MAX_NCHANNELS clamps the ring; before 2.28 NVLS raised it back to nvlsChannels.
    assert comm(H100x8, env={"NCCL_MAX_NCHANNELS": "4"}).nccl[0].channels == 4
    assert comm(H100x8, env={"NCCL_MAX_NCHANNELS": "4"}, version=(2, 27, 5)).nccl[0].channels == 16
    c = comm(H100x8, env={"NCCL_MAX_NCHANNELS": "4", "NCCL_NVLS_ENABLE": "0"}).nccl[0]
    assert c.channels == 4 and c.ring == 4 * 12 * MIB
    assert comm(H100x8, env={"NCCL_MIN_NCHANNELS": "32"}).nccl[0].channels == 32
    assert comm(H100x8, env={"NCCL_NVLS_NCHANNELS": "8"}).nccl[0].nvls == 8 * 2 * MIB * 8 + 2 * MIB + 8 * 2 * MIB


def test_a100_uses_p2p_read():
    c = comm(A100x8).nccl[0]
    # 12 links x 20 GB/s = 240; speed 40 -> 6 channels -> 12; no NVLS before sm90.
    assert (c.channels, c.nvls_channels, c.p2p_read) == (12, 0, True)
    # paths.cc: sm80 on NVLink reads: Simple moves to the sender (4096 + 4 MiB -> 6 MiB); the receiver
    # keeps 4096 + LL + LL128 = 5,443,584 B -> 6 MiB.
    assert c.ring == 12 * (6 + 6) * MIB
    forced = comm(A100x8, env={"NCCL_P2P_READ_ENABLE": "0"}).nccl[0]
    assert not forced.p2p_read and forced.ring == 12 * (2 + 10) * MIB


def test_runtime_connect_off_connects_the_tree_at_init():
    on = comm(H100x8).nccl[0]
    off = comm(H100x8, env={"NCCL_RUNTIME_CONNECT": "0"}).nccl[0]
    assert on.tree == 0 and off.tree == 12 * 12 * MIB and off.total == on.total + off.tree


def test_pcie_and_cumem_off():
    c = comm(Cluster(gpus=8, gpu_name="l40s", intra_link="pcie4")).nccl[0]
    assert (c.channels, c.nvls) == (2, 0)  # 24 GB/s: speed 20 -> 1 channel -> 2
    assert c.ring == 2 * 12 * MIB
    off = comm(H100x8, env={"NCCL_CUMEM_ENABLE": "0"}).nccl[0]
    assert off.nvls == off.channel_structs == off.dev_comm == 0 and off.ring == 12 * 12 * MIB


def test_multi_node_is_an_estimate_and_larger():
    two = comm(Cluster(gpus=16, gpu_name="h100-sxm", intra_link="nvlink4")).nccl[0]
    assert two.channels_source == "estimate" and two.channels == 24 and two.tree > 0
    assert two.total > comm(H100x8).nccl[0].total


def test_communicators_per_strategy():
    two_nodes = Cluster(gpus=16, gpu_name="h100-sxm", intra_link="nvlink4")
    assert fp.communicators(H100x8, 1, "none") == ()
    assert [c[0] for c in fp.communicators(two_nodes, 16, "node")] == ["shard", "replicate"]
    assert fp.communicators(two_nodes, 16, "node")[1] == ("replicate", 2, 1)
    assert fp.communicators(H100x8, 4, "world", tp=2) == (("data_parallel", 4, 4), ("tensor_parallel", 2, 2))
    # A replicate group with one rank per node has no NVLS and no intra-node ring.
    rep = comm(two_nodes, group="node").nccl[1]
    assert rep.nvls == 0 and rep.ring == rep.channels * 20 * MIB  # net send + receive, GDR: 10 + 10 MiB


def test_estimate_overhead_json_and_fits(monkeypatch):
    for var in fp.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    train = TrainConfig(resolve_model("llama-3-8b")[0], seq_len=1024)
    m = estimate_memory(train, H100x8, "fsdp")
    assert m.process_overhead == m.footprint.total == fp.CUDA_CONTEXT_BYTES + m.footprint.nccl[0].total
    d = m.to_dict()
    assert d["device_footprint"]["nccl"][0]["channels"] == 12
    assert d["process_overhead"] == d["device_footprint"]["total"]
    assert d["device_total"] == d["peak_reserved"] + d["process_overhead"]
    assert estimate_memory(train, H100x8, "fsdp", backend="gloo").process_overhead == fp.CUDA_CONTEXT_BYTES
    assert estimate_memory(train, H100x8, "single").footprint.nccl == ()
    # `fits` draws the line at the new overhead: a card between the two totals flips with NVLS.
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    off = estimate_memory(train, H100x8, "fsdp")
    assert off.process_overhead < m.process_overhead
    card = (off.device_total + m.device_total) // 2
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    on = estimate_memory(train, Cluster(gpus=8, gpu_name="h100-sxm", intra_link="nvlink4", gpu_memory_bytes=card), "fsdp")
    # (with NVLS the allocator must release its cache to fit: `fits` with retries, not cleanly)
    assert not on.fits_cleanly and (not on.fits or on.alloc_retries > 0)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    off = estimate_memory(train, Cluster(gpus=8, gpu_name="h100-sxm", intra_link="nvlink4", gpu_memory_bytes=card), "fsdp")
    assert off.fits_cleanly


# -- validate: NVML's per-process figure (no GPU needed: a fake pynvml) ------------------------------

class _Proc:
    def __init__(self, pid, used):
        self.pid, self.usedGpuMemory = pid, used


class _FakeNvml:
    """pynvml's surface that nvml_process_bytes uses: per device, a list of compute processes."""

    def __init__(self, devices, fail_init=False, fail_device=()):
        self.devices, self.fail_init, self.fail_device, self.shut = devices, fail_init, set(fail_device), False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        if handle[1] in self.fail_device:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.devices[handle[1]]


def test_nvml_process_bytes_parses_this_pid_only():
    from distplan.validate.probe import nvml_process_bytes
    nv = _FakeNvml([[_Proc(7, 5 * MIB), _Proc(42, 3 * MIB)], [_Proc(42, 1 * MIB)], []])
    assert nvml_process_bytes(42, nv) == (4 * MIB, 2) and nv.shut
    assert nvml_process_bytes(7, nv) == (5 * MIB, 1)
    assert nvml_process_bytes(99, nv) == (None, 0)  # another PID namespace: not seen
    assert nvml_process_bytes(42, _FakeNvml([[_Proc(42, None)]])) == (None, 0)  # NVML cannot tell
    assert nvml_process_bytes(42, _FakeNvml([[_Proc(42, 3)]], fail_init=True)) == (None, 0)
    assert nvml_process_bytes(42, _FakeNvml([[_Proc(42, 3)], [_Proc(42, 5)]], fail_device=[0])) == (5, 1)


def test_compare_reports_device_total_against_nvml_without_judging():
    from distplan.validate.compare import compare
    pred = {"fits": True, "memory": {"peak_allocated": 100 * MIB, "peak_reserved": 120 * MIB,
                                     "process_overhead": 800 * MIB, "device_total": 920 * MIB}}
    meas = {"status": "ok", "memory": {"peak_allocated": 100 * MIB, "peak_reserved": 120 * MIB,
                                       "nvml_process_bytes": 1000 * MIB, "reserved_at_nvml": 110 * MIB,
                                       "nccl_version": "2.27.5"}}
    out = compare(pred, meas)
    cell = out["device_total"]
    assert (cell["predicted"], cell["measured"]) == (920 * MIB, 1000 * MIB)
    assert cell["error"] == pytest.approx(-0.08)
    assert cell["measured_outside_allocator"] == 890 * MIB and cell["predicted_process_overhead"] == 800 * MIB
    assert cell["nccl_version"] == "2.27.5"
    assert "ok" not in cell and not any("device" in r for r in out["reasons"])
    del meas["memory"]["nvml_process_bytes"]  # a CPU probe: nothing reported
    assert "device_total" not in compare(pred, meas)


def test_pipeline_stage_counts_the_pp_communicator():
    from distplan.planner.pp import stage_memory
    train = TrainConfig(resolve_model("llama-3-8b")[0], seq_len=1024, pp=2, pp_microbatches=4)
    m = stage_memory(train, Cluster(gpus=16, gpu_name="h100-sxm", intra_link="nvlink4"), "fsdp", 0)
    names = [c.name for c in m.footprint.nccl]
    assert names == ["data_parallel", "pipeline"] and m.process_overhead == m.footprint.total
    # stride 16 / 2 = 8 = a whole node: the two stages sit on different nodes, one rank per node.
    assert m.footprint.nccl[1].ranks_per_node == 1 and m.footprint.nccl[1].nvls == 0
