//! Records what the notebooks' GPU cells print, on the GPU machine, for the committed notebooks
//! to show where there is no GPU: `record-live DIR DATE` writes `DIR/NAME.txt` for every check of
//! `ladder_notebook::live::RECORDED` (`docs/results/notebook-live/` in the repository). The
//! device's settings come from the same `LADDER_*` variables as the GPU tests'.

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let [_, dir, date] = args.as_slice() else {
        eprintln!("usage: record-live DIR DATE (e.g. docs/results/notebook-live 2026-12-03)");
        return std::process::ExitCode::from(2);
    };
    match ladder_notebook::live::record(std::path::Path::new(dir), date) {
        Ok(files) => {
            println!("record-live: {} recordings in {dir}", files.len());
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("record-live: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
