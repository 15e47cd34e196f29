"""The MASC gadget on the wire: ``settings`` (per-connection settings over the ``acquisition`` and
``gadget`` config sections), ``models`` (policy, MAR network and engine, built in one place),
``stages`` (the gadget loop as generator stages), ``gadget`` (``process`` and the Gadgetron entry
point ``masc``) and ``server`` (``masc serve``)."""
