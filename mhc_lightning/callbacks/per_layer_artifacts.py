"""PerLayerArtifacts: after each validation, the latest per-layer mHC diagnostics go into the MLflow run.

Three files per validation, named after the step the values were recorded at (LitLM.last_diagnostics_step), not the
step of the validation: `diagnostics/per_layer_step<step>.json` (what `mhc compare` reads back), the Amax-vs-layer
figure `diagnostics/amax_per_layer_step<step>.png` and the heatmaps of every sublayer's n x n H_res − I (token mean,
on a colour scale fitted to its range) and of the composite products, `diagnostics/h_res_step<step>.png`. The
module only keeps the values (LitLM.last_per_layer); this callback writes and draws them, so that training imports no
plotting. `mhc fit|validate|test` install it by default (fit/cli.py's build_cli), as FinalValidation.
"""

from lightning.pytorch.callbacks import Callback

from ..loggers.mlflow_runs import mlflow_loggers


class PerLayerArtifacts(Callback):
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        per_layer = getattr(pl_module, "last_per_layer", None)
        if trainer.sanity_checking or not per_layer or trainer.global_rank != 0:
            return
        loggers = mlflow_loggers(trainer)
        if not loggers:
            return
        import matplotlib.pyplot as plt

        from ..reports.plots import diagnostics_figure, h_res_heatmaps

        step = pl_module.last_diagnostics_step
        for lg in loggers:
            lg.experiment.log_dict(lg.run_id, per_layer, f"diagnostics/per_layer_step{step:07d}.json")
            fig = diagnostics_figure(per_layer, f"{pl_module.arch.hyper.residual_mode}, step {step}")
            lg.experiment.log_figure(lg.run_id, fig, f"diagnostics/amax_per_layer_step{step:07d}.png")
            plt.close(fig)
            if per_layer.get("h_res_tokmean"):
                fig = h_res_heatmaps(
                    [("", per_layer["h_res_tokmean"])],
                    f"{pl_module.arch.hyper.residual_mode}, step {step}: H_res per sublayer",
                )
                lg.experiment.log_figure(lg.run_id, fig, f"diagnostics/h_res_step{step:07d}.png")
                plt.close(fig)
