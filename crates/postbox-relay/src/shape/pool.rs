//! The threads expressions run on: a few, shared by every relay of the
//! process, each with a stack large enough for the depth an evaluation may
//! reach before it is stopped (`expr::MAX_STACK_BYTES`), so that no
//! expression runs on (or can overflow) a runtime worker's stack.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};

/// Each evaluator thread's stack (address space, touched only as used).
pub(crate) const STACK_BYTES: usize = 256 << 20;

type Job = Box<dyn FnOnce() + Send>;

struct Pool {
    jobs: Sender<Job>,
    threads: usize,
}

fn pool() -> Option<&'static Pool> {
    static POOL: OnceLock<Option<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let (jobs, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
        let mut started = 0;
        for i in 0..threads {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("postbox-expr-{i}"))
                .stack_size(STACK_BYTES)
                .spawn(move || work(&rx));
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!(error = %e, "could not start an expression thread"),
            }
        }
        (started > 0).then_some(Pool {
            jobs,
            threads: started,
        })
    })
    .as_ref()
}

fn work(rx: &Mutex<Receiver<Job>>) {
    super::expr::allow_deep_stack();
    loop {
        let job = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(poisoned) => poisoned.into_inner().recv(),
        };
        match job {
            // A job that panics loses its answer (its caller sees none),
            // never the thread.
            Ok(job) => {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            }
            Err(_) => return,
        }
    }
}

/// How many evaluator threads run (0: none could be started).
pub(crate) fn threads() -> usize {
    pool().map_or(0, |p| p.threads)
}

/// Run `f` on an evaluator thread and wait for its result without blocking
/// the runtime. `None` when no evaluator thread runs (none could be started).
pub(crate) async fn run<T, F>(f: F) -> Option<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let pool = pool()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job: Job = Box::new(move || {
        let _ = tx.send(f());
    });
    pool.jobs.send(job).ok()?;
    rx.await.ok()
}
