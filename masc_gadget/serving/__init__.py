"""The MASC gadget on the wire: ``settings`` (per-connection settings over the ``acquisition`` and
``gadget`` config sections), ``models`` (policy, MAR network and engine, built in one place),
``host`` (what a process serving streams holds: limits, operator settings, model cache, batcher,
memory budget), ``stages`` (the gadget loop ``process`` as generator stages), ``connection`` (one
client's handshake and items, in the ``mrd`` or ``gadgetron`` dialect), ``server`` (the listener
of ``masc serve`` and of connect mode) and ``gadget`` (the Gadgetron entry points)."""
