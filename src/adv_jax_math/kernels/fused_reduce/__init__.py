"""The fused Pallas map-reduce kernel (see ``fused``)."""
