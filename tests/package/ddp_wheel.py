"""DDP on backend "comm" from an installed wheel, with no environment variables: two processes
train a small model, and the ranks' parameters must agree afterwards. Run by scripts/test_wheel.sh
in a fresh virtual environment; prints where comm_torch and libcomm.so were loaded from."""

import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int) -> None:
    dist.init_process_group("comm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(rank)  # different data on each rank, and different initial weights
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 8)).square().mean().backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if not all(torch.equal(gathered[0], g) for g in gathered):
        raise SystemExit(f"rank {rank}: parameters differ between ranks after DDP steps")
    if rank == 0:
        import comm_torch
        from comm_torch import _lib

        print("comm_torch:", comm_torch.__file__)
        print("library:", _lib.library_path())
        print("backend:", dist.get_backend())
        print("DDP OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(worker, args=(2, free), nprocs=2, join=True)
    sys.exit(0)
