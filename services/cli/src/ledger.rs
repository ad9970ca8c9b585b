//! `jetrl status --ledger`: what became of every dataset row the job drew (the exactly-once ledger of
//! `jetrl_bus::ledger`), from the group records: a table, or one JSON object per row with `--json` (the same
//! lines the trainer writes to `<run.dir>/ledger.jsonl`).

use jetrl_bus::{Bus, GroupStore};
use jetrl_wire::subjects;

/// Prints the ledger of the train partition; fails when a row was decided by more than one group.
pub async fn print(bus: &Bus, json: bool) -> anyhow::Result<()> {
    let groups = GroupStore::open(bus).await?;
    let records = groups.records(subjects::TRAIN_PARTITION).await?;
    let (rows, duplicates) = jetrl_bus::ledger::ledger(&records);
    if json {
        for row in &rows {
            println!("{}", serde_json::to_string(row)?);
        }
    } else {
        println!("{:>5} {:>7} {:<38} {:<9} {:>6}  reason", "epoch", "row", "uid", "fate", "step");
        for r in &rows {
            let fate = serde_json::to_value(r.fate)?;
            println!(
                "{:>5} {:>7} {:<38} {:<9} {:>6}  {}",
                r.epoch,
                r.row,
                r.uid,
                fate.as_str().unwrap_or("?"),
                r.step,
                r.reason
            );
        }
    }
    anyhow::ensure!(
        duplicates.is_empty(),
        "{} dataset row(s) decided by more than one group (trained twice?): {:?}",
        duplicates.len(),
        duplicates
            .iter()
            .map(|d| d.iter().map(|r| (r.epoch, r.row, r.uid.as_str())).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    );
    Ok(())
}
