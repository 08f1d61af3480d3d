"""Sequence mixers other than attention: the Mamba2 mixer (`mamba2`) and its chunked scan
(`ssd`)."""
