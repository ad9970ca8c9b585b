//! `jetrl`: launches and inspects jetrl jobs. It owns nothing: the services do the work.

mod broker;
mod embedded;
mod layout;
mod ledger;
mod liveness;
mod preflight;
mod run;
mod status;
mod supervisor;
mod threads;

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use jetrl_cli::logprobs;

#[derive(Parser)]
#[command(name = "jetrl", version, about = "RL post-training over NATS JetStream")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a training job: start NATS (unless --nats-url), create the model if needed, start the five
    /// services as processes, show progress, write the run directory.
    ///
    /// `jetrl run FILE.yaml [section.key=value …]` reads a job in jetrl's tree; `jetrl run --verl [FILE.yaml]
    /// [key=value …]` reads verl's tree and Hydra's overrides as `python3 -m verl.trainer.main_ppo` takes them.
    Run {
        #[command(flatten)]
        job: JobArgs,
        /// use this NATS server instead of starting one
        #[arg(long)]
        nats_url: Option<String>,
        /// no progress bar (log lines instead)
        #[arg(long)]
        quiet: bool,
    },
    /// Print a job as the services will read it (jetrl's tree, every default filled in).
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Write a random-init model directory in HF format.
    InitModel {
        #[arg(long, default_value = "tiny")]
        preset: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Log-probs of token sequences or chat messages: JSON lines on stdin, one JSON line on stdout per input
    /// line (`{"line", "ids", "logprobs"}` or `{"line", "error"}`). Exits with status 1 when a line was refused.
    Logprobs {
        #[arg(long)]
        model: PathBuf,
        /// score with this PEFT adapter directory on the model (e.g. a LoRA run's
        /// `checkpoints/global_step_N/actor/lora_adapter`)
        #[arg(long)]
        lora: Option<PathBuf>,
        #[arg(long, default_value = "cpu")]
        device: String,
        #[arg(long, default_value = "f32")]
        dtype: String,
    },
    /// Write a model directory: with --merge, the base model with a LoRA adapter folded into its weights (an HF
    /// model directory transformers and vLLM load as is).
    Export {
        /// fold the adapter into the base weights (the one export there is, required to say what it does)
        #[arg(long, required = true)]
        merge: bool,
        /// the base model directory
        #[arg(long)]
        model: PathBuf,
        /// the PEFT adapter directory
        #[arg(long)]
        lora: PathBuf,
        /// the output directory (created; files in it are overwritten)
        #[arg(long)]
        out: PathBuf,
        /// the weights' dtype in the output: f32, bf16, or the base's own (default)
        #[arg(long)]
        dtype: Option<String>,
    },
    /// Show a running job: the trainer's step, rate and reward, every service's health, groups by state, a
    /// staleness histogram, weight versions per worker, consumers that lag, dead letters, the streams' replicas,
    /// and optionally the ledger of prompt groups. NATS settings (URL, credentials, TLS) come from the `nats`
    /// section of --config, `JETRL__NATS__*` environment variables and `nats.key=value` overrides, as for the
    /// services.
    Status {
        /// a job file, or just a `nats:` section (deploy/nats/gen.sh writes one per identity: clients/status/nats.yaml)
        #[arg(long, short = 'c')]
        config: Option<PathBuf>,
        /// overrides, `nats.key=value`
        overrides: Vec<String>,
        /// the server URL (overrides nats.url)
        #[arg(long)]
        nats_url: Option<String>,
        /// the job's namespace (default: the config's `nats.namespace`, else its `run.name`, else `jetrl`)
        #[arg(long)]
        namespace: Option<String>,
        /// what became of every dataset row drawn: trained (at which step), evicted or failed (why), in flight
        #[arg(long)]
        ledger: bool,
        /// list these groups' entries in the replay buffer (state, submit and trained step, trajectories)
        #[arg(long)]
        uid: Vec<String>,
        /// one JSON object (per refresh with --watch: JSON lines), for scripts; with --ledger, only the ledger,
        /// one JSON object per row (what the trainer writes to ledger.jsonl)
        #[arg(long)]
        json: bool,
        /// refresh every SECONDS (default 2) until interrupted
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2")]
        watch: Option<f64>,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// The resolved job: `jetrl config show FILE [overrides]`, or `jetrl config show --verl [FILE] [overrides]` for
    /// verl's tree (what was ignored goes to stderr)
    Show {
        #[command(flatten)]
        job: JobArgs,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run { job, nats_url, quiet } => {
            let job = job.resolve()?;
            let (config, overrides, placement) = match job.verl_translation()? {
                Some((translated, ignored, placement)) => {
                    if let Some(line) = ignored {
                        eprintln!("{line}");
                    }
                    (translated, Vec::new(), placement)
                }
                None => (
                    job.file.context("jetrl run needs a job file (or --verl)")?,
                    job.overrides,
                    layout::Placement::Auto,
                ),
            };
            let runtime = tokio::runtime::Runtime::new()?;
            let code = runtime.block_on(run::run(&config, overrides, nats_url, quiet, placement))?;
            std::process::exit(code);
        }
        Command::Config { command: ConfigCommand::Show { job } } => {
            let job = job.resolve()?;
            let cfg = if job.verl {
                let translated = jetrl_config::load_verl(job.file.as_deref(), &job.overrides)?.with_hybrid_workers()?;
                if let Some(line) = translated.ignored_line() {
                    eprintln!("{line}");
                }
                translated.typed()?
            } else {
                jetrl_config::JobConfig::load(job.file.as_deref(), &job.overrides)?
            };
            print!("{}", serde_yaml::to_string(&cfg)?);
            Ok(())
        }
        Command::InitModel { preset, out, seed } => {
            jetrl_model::init_model(&preset, &out, seed)?;
            println!("wrote {preset} model to {}", out.display());
            Ok(())
        }
        Command::Logprobs { model, lora, device, dtype } => {
            let device = jetrl_model::parse_device(&device)?;
            let dtype: jetrl_model::DType = dtype.parse()?;
            let (stdin, stdout) = (std::io::stdin().lock(), std::io::stdout().lock());
            let summary = logprobs::logprobs_jsonl(&model, lora.as_deref(), device, dtype, stdin, stdout)?;
            if summary.refused > 0 {
                eprintln!("jetrl logprobs: {} of {} lines refused (see their `error`)", summary.refused, summary.lines);
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Export { merge: _, model, lora, out, dtype } => {
            let dtype = dtype.map(|d| d.parse()).transpose()?;
            let summary = jetrl_cli::export::merge(&model, &lora, &out, dtype)?;
            println!("{summary}");
            Ok(())
        }
        Command::Status { config, mut overrides, nats_url, namespace, ledger, uid, json, watch } => {
            jetrl_telemetry::init_tracing("warn", jetrl_config::LogFormat::Text);
            overrides.extend(nats_url.map(|url| format!("nats.url={url}")));
            let target = status::target(config.as_deref(), &overrides, namespace)?;
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(status::status(&target, status::Options { ledger, uids: uid, json, watch }))
        }
    }
}

/// A job named on the command line, as `jetrl run` and `jetrl config show` take it.
#[derive(clap::Args)]
struct JobArgs {
    /// the job file (YAML), then overrides (`section.key=value`); with --verl the file is optional and the
    /// overrides are Hydra's (`a.b=1`, `+a.b=1`, `~a.b`)
    args: Vec<String>,
    /// read verl's configuration (its key tree, defaults and Hydra overrides): see docs/configuration.md
    #[arg(long)]
    verl: bool,
    /// Hydra's `--config-path` (with --verl): the directory of --config-name's file
    #[arg(long, requires = "verl")]
    config_path: Option<PathBuf>,
    /// Hydra's `--config-name` (with --verl): a YAML file in --config-path, `.yaml` optional
    #[arg(long, requires = "verl")]
    config_name: Option<String>,
}

/// The job's file (optional with --verl) and overrides.
struct Job {
    file: Option<PathBuf>,
    overrides: Vec<String>,
    verl: bool,
}

impl JobArgs {
    /// The first argument is the file unless it reads as an override (`key=value`, `+key…`, `~key`); Hydra's
    /// `--config-path`/`--config-name` name the file instead.
    fn resolve(self) -> anyhow::Result<Job> {
        let JobArgs { mut args, verl, config_path, config_name } = self;
        let first_is_file =
            args.first().is_some_and(|a| !a.contains('=') && !a.starts_with('~') && !a.starts_with('+'));
        let mut file = first_is_file.then(|| PathBuf::from(args.remove(0)));
        if let Some(name) = config_name {
            anyhow::ensure!(file.is_none(), "give the job file either as an argument or with --config-name, not both");
            let name = if name.ends_with(".yaml") || name.ends_with(".yml") { name } else { format!("{name}.yaml") };
            file = Some(config_path.unwrap_or_default().join(name));
        } else {
            anyhow::ensure!(
                config_path.is_none(),
                "--config-path names the directory of --config-name's file: give both"
            );
        }
        Ok(Job { file, overrides: args, verl })
    }
}

impl Job {
    /// With --verl: the job translated into jetrl's tree, written to `<run.dir>/verl_job.yaml` (after its checks
    /// pass), the line saying what was ignored, and where verl's keys put the rollout workers: on GPUs of their own
    /// with the fully-async recipe's `rollout.n_gpus_per_node`, else on the trainer's GPUs (verl's hybrid engine:
    /// `trainer.n_gpus_per_node` GPUs that train and roll out, one worker on each unless the job says how many).
    fn verl_translation(&self) -> anyhow::Result<Option<(PathBuf, Option<String>, layout::Placement)>> {
        if !self.verl {
            return Ok(None);
        }
        let job = jetrl_config::load_verl(self.file.as_deref(), &self.overrides)?.with_hybrid_workers()?;
        let placement = match job.rollout_gpus() {
            jetrl_config::verl::layout::RolloutGpus::Apart => layout::Placement::Separate,
            jetrl_config::verl::layout::RolloutGpus::Shared => layout::Placement::Colocated,
        };
        let cfg = job.typed()?;
        preflight::check_devices(&cfg, preflight::visible_cuda_devices(), preflight::Spelling::Verl)
            .map_err(anyhow::Error::msg)?;
        let dir = PathBuf::from(&cfg.run.dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("verl_job.yaml");
        std::fs::write(&path, serde_yaml::to_string(&job.value)?)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Some((path, job.ignored_line(), placement)))
    }
}
