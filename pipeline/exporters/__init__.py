"""Who exports and lowers, one module per route; the file name is the `export.exporter` value.

Each declares:
    STAGE_PEAK                    -- export's and lower's peak RSS (pipeline/preflight.py memory estimates)
    NATIVE_RUNNER                 -- the C++ runners run its programs (verify.native: null follows it)
    problems(cfg), geometry_problems(cfg, geometry) -- what the route cannot build: [(key, value, why)]
    export(ctx), lower(ctx)       -- the export and lower stages' work; lower writes lower.json with a `program`
                                     record (layout, file(s), runtime, kernels) that pipeline/runtimes opens
    artifacts(lower_entry)        -- the run manifest's `pte` (and `programs`)
"""
from __future__ import annotations

from pipeline.exporters import native, transformers
from pipeline.registry import Registry

EXPORTERS = Registry("export.exporter", {m.__name__.rsplit(".", 1)[-1]: m for m in (native, transformers)})
