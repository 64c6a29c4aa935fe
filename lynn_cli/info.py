"""``lynn info``: what this process runs on (device, backend, versions)."""

from __future__ import annotations


def add(sub):
    return sub.add_parser("info", help="show the device and backend")


def run(args) -> int:
    from lynn_kernels import device_summary

    for k, v in device_summary().items():
        print(f"{k:>10}: {v}")
    return 0
