"""Benchmarks of dcp_atomic against stock DCP; ``python benchmarks/bench.py SCENARIO`` runs one.

Layout
    bench.py        the command: picks a scenario, parses its options, writes its JSON
    world.py        the world launcher (the tests' own ``testbed.worlds.run_world``) and the measured
                    save / load round of world scenarios
    contenders.py   how each contender (dcp_atomic formats, stock DCP variants, torch.save) saves and loads
    common.py       state dicts, bit-exact checks, memory probes, media (disk, tmpfs)
    report.py       medians and ratios, tables, target verdicts, JSON, the chart
    large.py        scenario: a transformer's large tensors, worlds 1-4, disk + tmpfs
    small.py        scenario: many small tensors (10k / 50k keys per rank), worlds 1-4
    compression.py  scenario: zstd on the real MiniLM weights
    s3.py           scenario: S3 through a local server
    scale.py        coordinator cost at 256-4,096 ranks without processes (its own command)
    gpu_check.py    CUDA tensors through every format (its own command, for a GPU machine)

A new scenario is one module with ``add_arguments(parser)``, optionally ``finish_arguments(parser,
args)``, and ``run(args) -> dict`` (the JSON document; it prints its own tables with report.py), plus
its name in ``bench.py``'s ``SCENARIOS``.  The read-once restore scenario (issue 13) goes in
``restore.py``: a world scenario like small.py whose contenders load replicated state.
"""
