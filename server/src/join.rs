//! A batch's per-item futures, run together and answered in order.
//!
//! `futures_util::future::join_all` keeps up to 30 futures in place and polls
//! each on every wake-up; over 30 it gives every future a task of its own in
//! a `FuturesUnordered` (an `Arc` allocated per future, its own waker, a
//! ready queue, and a `FuturesOrdered` to put the outputs back in order). A
//! batch's items mostly finish on their first poll (nothing to wait for) or
//! all at one wake-up (their shared statement answered), which the in-place
//! kind does with one poll each. At 256 callers, in statements of about 50
//! items, the per-task machinery (`FuturesUnordered`, `FuturesOrdered` and
//! their collecting) was 6-8 % of the server's CPU (`perf`,
//! docs/performance.md). So [`join_in_order`] joins chunks of 30 or fewer,
//! and the chunks' joins, every one of them of the in-place kind up to 900
//! futures (above that the outer join is `join_all`'s other kind).
//!
//! Polling in place re-polls the futures not yet done on each wake-up: items
//! that finish one by one, each after its own wait, cost a poll of each other
//! item per wake-up, O(n²) polls for the batch at worst. A poll of a future
//! still waiting is cheap next to the round trip each such wake-up waited
//! for, and a batch holds at most `--max-batch-items` (100 by default).

use std::future::Future;

use futures_util::future::join_all;

/// Most futures one in-place join holds: `join_all`'s own limit for it.
const IN_PLACE: usize = 30;

/// Runs `futures` concurrently and answers their outputs in their order.
/// Takes the futures at once, as `join_all` does: the future it returns
/// holds them, not the iterator they came from.
pub fn join_in_order<F: Future>(
    futures: impl IntoIterator<Item = F>,
) -> impl Future<Output = Vec<F::Output>> {
    // `Take` bounds its size hint by IN_PLACE, so each `join_all` keeps its
    // futures in place, without first collecting them into a Vec.
    let mut futures = futures.into_iter().peekable();
    let mut chunks = Vec::new();
    while futures.peek().is_some() {
        chunks.push(join_all(futures.by_ref().take(IN_PLACE)));
    }
    async move {
        match chunks.len() {
            1 => chunks.pop().expect("one chunk").await,
            _ => join_all(chunks).await.into_iter().flatten().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn outputs_come_in_the_futures_order_whatever_order_they_finish_in() {
        for count in [0, 1, 29, 30, 31, 64, 100, 901, 1000] {
            let futures = (0..count).map(|i| async move {
                // Every third waits, the later ones less long (with a
                // millisecond timer, only the larger counts finish them in
                // another order than given).
                if i % 3 == 0 {
                    tokio::time::sleep(Duration::from_micros(((count - i) * 10) as u64)).await;
                }
                i
            });
            let outputs = join_in_order(futures).await;
            assert_eq!(outputs, (0..count).collect::<Vec<_>>(), "{count} futures");
        }
    }

    #[tokio::test]
    async fn the_futures_run_concurrently() {
        // Item i waits for item i + 1's signal, the last for none: run one
        // after the other, the first would wait forever.
        let count = 100;
        let (senders, receivers): (Vec<_>, Vec<_>) = (1..count)
            .map(|_| tokio::sync::oneshot::channel::<()>())
            .unzip();
        let mut senders: Vec<_> = senders.into_iter().map(Some).collect();
        let mut receivers: Vec<_> = receivers.into_iter().map(Some).collect();
        let futures: Vec<_> = (0..count)
            .map(|i| {
                let wait = receivers.get_mut(i).and_then(Option::take);
                let signal = i.checked_sub(1).and_then(|before| senders[before].take());
                async move {
                    if let Some(wait) = wait {
                        wait.await.unwrap();
                    }
                    if let Some(signal) = signal {
                        let _ = signal.send(());
                    }
                    i
                }
            })
            .collect();
        let outputs = tokio::time::timeout(Duration::from_secs(5), join_in_order(futures))
            .await
            .expect("the futures ran concurrently");
        assert_eq!(outputs, (0..count).collect::<Vec<_>>());
    }
}
