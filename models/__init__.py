"""Downstream models built on vispe's public API only: DETR (detection) and NeRF / coordinate MLPs."""
