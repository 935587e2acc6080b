"""The only place that knows model architectures.

`fewbits.models.spec` (pure Python, no torch) describes a model's shape for the cost model.
Keep this file free of torch imports: `fewbits plan` imports the package on its cold-start path.
"""
