"""arspec's decoding core: models, engines, sampling. Plain PyTorch (no Ray, no Hydra): docs/design.md.

BYTES_VERSION names how this code turns (settings, seed, prompt) into tokens and image bytes. Bump it
with any change that alters them for the same inputs (the random streams, the sampler, an engine's
use of its draws): the job records it in out_dir/job.json and refuses to complete an out_dir written
by another version, whose images would not match. tests/test_sampling.py pins the tokens it gives.
  1  numpy PCG64 stream per prompt, host-side inverse CDF
  2  counter-based hash streams on the device (decoding/sampling.py), device-side sampling and trials
  3  tree engines commit the target's own draws (verify.py): their tokens are vanilla's for the same seed
  4  a token is drawn by an exponential race (sampling.sample) keyed per position, not an inverse CDF
  5  the race's times from all 32 bits (sampling.exponential), uniforms on the 2^-23 grid (sampling.unit):
     both strictly inside their range in float32 (the 2^-24 grid's top value was 1.0, which drew tokens
     of zero mass); temperature applied after subtracting the row's maximum; mc_sjd's Gumbel coupling is
     the same race as `sample`; a Jacobi draft with p >= q passes without reading its uniform; a cspd
     draft proposes a draw of its final Gaussian (μ_q + σ_q ε_0), not its mean
  6  the shipped continuous shapes MAR and its draft sample with 25 diffusion steps (was 100); cspd's
     defaults are 16 drafts per window after a 5% prefill (were 8 and 15%)
  7  sjd and mc_sjd are the tree engine's chain steps (chains.py): their draws are keyed by the row's
     step count and token position, their windows stop before the last token (its bonus draw)
"""
BYTES_VERSION = 7
