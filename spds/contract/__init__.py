"""The run contract: what every command checks before any work.

gate        load a config: parse, apply the schema's defaults, validate, check pins
schema      the JSON Schemas (spds/schemas/): a strict validator and their defaults
settings    typed, frozen views of a validated config, one per section
config      the validated config every command reads: sections, paths, identity
checks      the rules beyond the schema (inputs exist, outputs never overlap them, ...)
pins        the sha256 of every input a config names, checked before any work
documents   the files a corpus context names, and its digest
digests     those sha256s, each file's remembered
versions    the dependency versions spds is tested with
hub         Hugging Face model ids, resolved offline
model_config  a model's config.json read without the model: its text part, its position window
kinds       self-study's seed kinds: the built-in ones, their instructions and openings
"""
