"""Byte formats, leaf code that kernels, the cache and the loaders share: FP8 e4m3 / FP4 e2m1
codes with their UE8M0 scales (`quant`), the 584-byte fp8_ds_mla KV records and the 132-byte
indexer rows (`layouts`)."""
