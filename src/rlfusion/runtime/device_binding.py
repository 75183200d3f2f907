"""Where a device worker runs: its torch device (`deploy.device`: the GPU Ray shows it, or the
CPU), the rendezvous store of the device world (listening on one address only), and what leaves
the device for the driver (host memory)."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from rlfusion.errors import RunError


def local_device(device: str) -> str:
    """`deploy.device` for this process: "auto" is "cuda" when torch sees a GPU here."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RunError(f"deploy.device=cuda: torch {torch.__version__} sees no CUDA device here "
                       f"({'a CPU-only build' if torch.version.cuda is None else 'none usable'}); set deploy.device=cpu")
    return device


def bind_device(kind: str, device: int) -> torch.device:
    """The torch device of device worker `device` (`DeploymentPlan.device`; "auto", which the
    backends resolve before they start workers, resolves here for this process). On CUDA it is
    the one GPU this process sees (Ray shows each device worker only its own through
    `CUDA_VISIBLE_DEVICES`; the local backend takes the current one), made current."""
    if kind == "auto":
        kind = local_device(kind)
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise RunError(f"device {device}: deploy.device={kind!r} is invalid (allowed: auto, cpu, cuda)")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        build = f"torch {torch.__version__} has no CUDA" if torch.version.cuda is None else "no CUDA device is usable"
        raise RunError(f"deploy.device=cuda: device {device} was given GPU {visible!r} but {build}; "
                       f"install a CUDA build of torch or set deploy.device=cpu")
    where = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(where)
    return where


def on_host(state: Any) -> Any:
    """`state` (nested dicts and lists of tensors) with every tensor in host memory: what leaves
    the device for the driver, which may have no GPU."""
    if isinstance(state, torch.Tensor):
        return state.cpu() if state.device.type != "cpu" else state
    if isinstance(state, dict):
        return {k: on_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_host(v) for v in state)
    return state


def listening_store(host: str, world_size: int) -> dist.TCPStore:
    """The rendezvous store's server, listening on `host` alone. torch binds every interface
    whatever host it is given, so the socket is bound here and handed over as the listen fd."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    # the store owns the socket from here (detach: Python's socket object must not close it)
    return dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def join_world(device: int, num_devices: int, where: torch.device, address: tuple[str, int],
               store: dist.TCPStore | None, groups: list[tuple[list[int], str | None]]) -> list[Any]:
    """Join the device world as rank `device` through the rendezvous store at `address` (`store`:
    device 0's own, from `listening_store`) and create `groups`, (ranks, backend or None for the
    world's) each — every rank creates every group, in the same order. On GPUs the world runs
    NCCL for device tensors and gloo for host tensors (counts, flags, objects). Returns the groups."""
    backend = "cpu:gloo,cuda:nccl" if where.type == "cuda" else "gloo"
    if store is None:
        store = dist.TCPStore(address[0], address[1], num_devices, is_master=False)
    dist.init_process_group(backend, store=store, rank=device, world_size=num_devices)
    return [dist.new_group(ranks, backend=group_backend) for ranks, group_backend in groups]
