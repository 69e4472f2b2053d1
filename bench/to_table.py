"""Turn the main job's JSON (``python3 -m bench --full --json results.json``) into the README's
Markdown benchmark table.

Usage: python bench/to_table.py results.json
"""

import json
import sys


def _machine_notes(results):
    """The machine line's note on the 64 MB copy and the 64 MB streamed write (results saved
    before they were measured have none)."""
    notes = [
        f"{what}: {results[key]:.1f} GB/s"
        for key, what in (("case_size_copy_gbps", "a 64 MB copy"), ("stream_write_gbps", "a 64 MB streamed write"))
        if results.get(key) is not None
    ]
    return f" ({'; '.join(notes)})" if notes else ""


def table(results):
    machine = results["machine"]
    lines = [
        f"Machine: {machine['cpu']}, {machine['threads']} threads ({machine['threading_layer']}), "
        f"parallel copy {results['bandwidth_gbps']:.1f} GB/s{_machine_notes(results)}; fastbwd {machine['fastbwd']}, "
        f"numba {machine['numba']}, torch {machine['torch'] or 'not installed'} (same thread count).",
        "",
        "| case | operator | dtype | variant | fastbwd ms | GB/s | % of copy bw | baseline | baseline ms | speed-up |",
        "|---|---|---|---|---:|---:|---:|---|---:|---:|",
    ]
    bridge = [row for row in results["rows"] if row["op"] == "fastbwd.torch"]
    overhead = [row for row in results["rows"] if row["op"] == "fastbwd.torch overhead"]
    jax_bridge = [row for row in results["rows"] if row["op"] == "fastbwd.jax"]
    for row in results["rows"]:
        if row["op"].startswith(("fastbwd.torch", "fastbwd.jax")):
            continue
        baseline = row["baseline"] or "-"
        base_ms = f"{row['baseline_ms']:.2f}" if row["baseline_ms"] is not None else "-"
        speedup = (
            f"**{row['speedup']:.{2 if row['speedup'] < 1 else 1}f}x**" if row["speedup"] is not None else "-"
        )  # two decimals below 1 (the NHWC/NCHW ratio has a target of 0.8)
        lines.append(
            f"| {row['case']} | {row['op']} | {row['dtype']} | {row['variant']} | {row['ms']:.2f} | "
            f"{row['gbps']:.1f} | {row['pct_bandwidth']:.0f}% | {baseline} | {base_ms} | {speedup} |"
        )
    if bridge:
        lines += [
            "",
            "PyTorch models through `fastbwd.torch` against plain PyTorch (autograd, same threads):",
            "",
            "| case | what | fastbwd.torch ms | PyTorch ms | speed-up | target |",
            "|---|---|---:|---:|---:|---|",
        ]
        for row in bridge:
            lines.append(
                f"| {row['case']} | {row['label']} | {row['ms']:.2f} | {row['baseline_ms']:.2f} | "
                f"**{row['speedup']:.2f}x** | {row['target']} |"
            )
    if overhead:
        lines += [
            "",
            "Per-call cost of the routing on tiny inputs (median microseconds; the aten "
            "`.grad_input` call routed to fastbwd, the direct fastbwd call with `out=` on the "
            "same memory, and the same aten call on PyTorch's own kernel):",
            "",
            "| case | what | routed us | direct us | routing adds | PyTorch us |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for row in overhead:
            lines.append(
                f"| {row['case']} | {row['label']} | {row['routed_us']:.1f} | {row['direct_us']:.1f} | "
                f"{row['routed_us'] - row['direct_us']:.1f} | {row['torch_us']:.1f} |"
            )
    if jax_bridge:
        lines += [
            "",
            f"JAX programs through `fastbwd.jax` against JAX's own gradients (jax "
            f"{machine.get('jax')}, CPU; `jax.jit(jax.grad(loss))`, same forward, same process):",
            "",
            "| case | what | fastbwd.jax ms | JAX ms | speed-up | target |",
            "|---|---|---:|---:|---:|---|",
        ]
        for row in jax_bridge:
            if row["case"] == "overhead":
                continue
            jax_ms = f"{row['baseline_ms']:.2f}" if row["baseline_ms"] is not None else "-"
            speedup = f"**{row['speedup']:.2f}x**" if row["speedup"] is not None else "-"
            lines.append(
                f"| {row['case']} | {row['label']} | {row['ms']:.2f} | {jax_ms} | {speedup} | {row['target']} |"
            )
        for row in jax_bridge:
            if row["case"] == "overhead":
                lines += [
                    "",
                    f"Transport cost: {row['ms'] * 1e3:.0f} us per FFI call (the slope between jitted "
                    f"programs of 1 and 11 chained calls whose handler does nothing; the 1-call program "
                    f"takes {row['baseline_ms'] * 1e3:.0f} us).",
                ]
    return "\n".join(lines)


def main(argv):
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[1]) as handle:
        print(table(json.load(handle)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
