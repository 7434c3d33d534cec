"""How many bytes the allocator hands cuBLAS/cuBLASLt: memory_allocated around the first matmul on the
main thread, on a second thread, and in a backward pass (autograd's device thread)."""
import threading
import torch

d = torch.device("cuda")
a = torch.randn(256, 256, device=d)
torch.cuda.synchronize()
def delta(fn):
    before = torch.cuda.memory_allocated(d)
    fn(); torch.cuda.synchronize()
    return torch.cuda.memory_allocated(d) - before
print("fp32 mm main thread", delta(lambda: a @ a))
print("fp32 mm again", delta(lambda: a @ a))
print("bf16 mm main", delta(lambda: a.bfloat16() @ a.bfloat16()))
print("addmm bias main", delta(lambda: torch.nn.functional.linear(a, a, a[0])))
res = {}
t = threading.Thread(target=lambda: res.setdefault("t", delta(lambda: a @ a))); t.start(); t.join()
print("fp32 mm other thread", res["t"])
w = torch.randn(256, 256, device=d, requires_grad=True)
x = torch.randn(256, 256, device=d)
print("backward (autograd thread)", delta(lambda: (x @ w).sum().backward()))
print("side stream", delta(lambda: torch.cuda.stream(torch.cuda.Stream()).__enter__() or a @ a))
import os
print("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "CUBLASLT_WORKSPACE_SIZE", os.environ.get("CUBLASLT_WORKSPACE_SIZE"))
print("cap", torch.cuda.get_device_capability(), torch.__version__)
