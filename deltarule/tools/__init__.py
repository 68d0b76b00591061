"""Tools around the operator: the `deltarule` command (`cli`), `check` against the reference, `bench`
beside the peers, `oracles` (the other runtimes run as references), `versions`, `paths`."""
