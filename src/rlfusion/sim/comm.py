"""Collective communication times on a `ClusterSpec`: ring collectives and MoE all-to-all.

Owns the volume formulas (bytes each rank sends) and the alpha-beta time model
`time = hops * latency + bytes / bandwidth`. Knows nothing about which collectives a plan
issues; `step.py` decides that.

Ring volumes per rank for a buffer of `B` bytes over `n` ranks (the textbook bandwidth-optimal
algorithms): all-gather and reduce-scatter send `(n-1)/n * B` in `n-1` hops; all-reduce =
reduce-scatter + all-gather, `2 (n-1)/n * B` in `2 (n-1)` hops.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfusion.sim.hardware import ClusterSpec, LinkSpec


def ring_volume(kind: str, num_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring collective of `kind` over `n` ranks."""
    if n <= 1:
        return 0.0
    factor = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}[kind]
    return factor * (n - 1) / n * num_bytes


def ring_time(kind: str, num_bytes: float, n: int, link: LinkSpec) -> float:
    if n <= 1:
        return 0.0
    hops = (2 if kind == "all_reduce" else 1) * (n - 1)
    return hops * link.latency_us * 1e-6 + ring_volume(kind, num_bytes, n) / (
        link.bandwidth_GBps * 1e9)


def p2p_time(num_bytes: float, link: LinkSpec) -> float:
    return link.latency_us * 1e-6 + num_bytes / (link.bandwidth_GBps * 1e9)


@dataclass(frozen=True)
class AllToAllVolume:
    """Bytes one rank sends over each fabric in one MoE dispatch (or combine)."""

    intra_bytes: float
    inter_bytes: float


def expected_remote_domains(num_domains: int, top_k: int) -> float:
    """Expected number of *other* domains that host at least one of a token's top_k experts,
    with experts spread uniformly over `num_domains` domains of the EP group."""
    if num_domains <= 1:
        return 0.0
    return (num_domains - 1) * (1.0 - (1.0 - 1.0 / num_domains) ** top_k)


def all_to_all_volume(tokens: float, hidden: int, top_k: int, ep: int, local: int,
                      hierarchical: bool, bytes_per_elem: int = 2) -> AllToAllVolume:
    """Volume of one dispatch for `tokens` tokens held by this rank.

    `local` EP ranks share this rank's fast domain. Flat: every (token, expert) copy goes
    straight to its destination, so a fraction `(ep - local) / ep` of the copies crosses the
    slow network. Hierarchical: a token crosses the network once per remote *domain* that
    hosts one of its experts (no duplicates), then is fanned out to experts inside the domain.
    """
    token_bytes = tokens * hidden * bytes_per_elem
    copies = token_bytes * top_k
    if ep <= 1:
        return AllToAllVolume(0.0, 0.0)
    if not hierarchical or local >= ep:
        return AllToAllVolume(copies * (local - 1) / ep, copies * (ep - local) / ep)
    domains = ep // local
    inter = token_bytes * expected_remote_domains(domains, top_k)
    # After the inter-domain gather, each domain fans its (token, expert) copies out locally.
    intra = copies * (local - 1) / local
    return AllToAllVolume(intra, inter)


def all_to_all_time(volume: AllToAllVolume, cluster: ClusterSpec, ep: int, local: int,
                    hierarchical: bool) -> float:
    intra_s = volume.intra_bytes / (cluster.intra.bandwidth_GBps * 1e9)
    inter_s = volume.inter_bytes / (cluster.inter.bandwidth_GBps * 1e9)
    latency = (local - 1) * cluster.intra.latency_us * 1e-6
    if ep > local:
        latency += (ep // local - 1) * cluster.inter.latency_us * 1e-6
    # Flat a2a drives both fabrics at once; hierarchical runs its two phases back to back.
    transfer = intra_s + inter_s if hierarchical else max(intra_s, inter_s)
    return transfer + latency
