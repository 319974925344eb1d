"""An example Esper plugin distribution.

Esper imports nothing from here until a registry lookup loads the entry points named in
``pyproject.toml``; keep this module light so that loading one plugin stays cheap.

- ``esper_example_plugin.blueprints:SQUEEZE_EXCITE``: blueprint ``squeeze_excite``
- ``esper_example_plugin.callbacks:SeedCounter``: callback ``seed_counter``
"""

__version__ = "0.1.0"
