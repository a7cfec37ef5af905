"""Analytic cost models: learners as step times and links, no training math.

  link.py   a wide-area link as a FIFO queue (also the virtual-clock runtime's links)
  wan.py    time to train across regions: data-parallel, DiLoCo and decoupled streaming DiLoCo
  scale.py  goodput under chip failures at scale, cost-model learners driven by the real syncer
"""
