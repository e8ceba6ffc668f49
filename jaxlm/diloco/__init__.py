"""DiLoCo, semi-synchronous training (arXiv 2311.08105; streaming: arXiv 2501.18512), as one package.

- `config`: the `diloco` section of a run's config (DiLoCoConfig) and its checks;
- `program`: M replicas on the `replica` mesh axis inside one compiled program (inner steps, outer Nesterov steps,
  streaming fragments, simulated drops);
- `processes`: one replica per process, syncing through `exchange` (a shared directory that survives the death of
  any replica) with outer gradients encoded by `compression`.

The rest of jaxlm knows DiLoCo by two names: `DiLoCoConfig` (a section of TrainConfig) and `make_program`. This
module imports nothing at load time, so `jaxlm.config` can import the config section without the programs.
"""

from __future__ import annotations


def make_program(cfg, mesh, layout=None):
    """The DiLoCo program for a config whose `diloco` section is on: one replica of it per process with
    `diloco.exchange`, else every replica inside one program."""
    if cfg.diloco.in_processes:
        from jaxlm.diloco.processes import ProcessDiLoCoProgram

        return ProcessDiLoCoProgram(cfg, mesh, layout)
    from jaxlm.diloco.program import DiLoCoProgram

    return DiLoCoProgram(cfg, mesh, layout)
