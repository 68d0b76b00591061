"""Tools around the operator: the `deltarule` command (`cli`), `check` against the reference,
`bench` beside the peers (and `bench.onnx_block`, a GDN-2 block in ONNX), `oracles` (the other
runtimes run as references), `versions` (the tested releases), `paths` (output paths checked
before long work) and `eager_source` (the writer of `deltarule/eager.py`)."""
