"""The targets of the deviceless compiles and of the models: short name -> the
``device_kind`` JAX reports, in the device table's order (``adv_jax_math._devices``).
Importing it sets up no devices."""

from adv_jax_math.core.devices import DEVICES

KINDS = {d.target: d.kind for d in DEVICES.values()}
