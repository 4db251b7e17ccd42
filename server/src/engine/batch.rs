//! A batch RPC's items, run together. Items for the same record run one
//! after the other, in the order given: the k-th item for a record runs in
//! round k (see [`rounds`]), whatever the store does with concurrent calls.
//! Each round's items that the replay cache does not answer reach the
//! store as one unit (`insert_or_read_all`, `finish_all`), and a round's
//! records are distinct, so with batching a
//! round of up to `--batch-max-size` items is one statement by construction;
//! a larger round is split, in order, into statements of that size. An item
//! whose record another caller's call already has in that statement, or in
//! a running one, waits for a later statement (see
//! [`batch`](crate::store::batch)). Then each item's follow-ups (a takeover,
//! a renewal, a miss explained) run concurrently.

use std::{collections::HashMap, future::Future, sync::Arc, time::Instant};

use super::{
    AcquireRequest, Answer, CompleteRequest, Engine, acquire_input, finish_input, rules::acquired,
};
use crate::{
    domain::{AcquireOutcome, RecordId, RecordState, Timestamp},
    error::Error,
    join::join_in_order,
    store::AcquireInput,
};

impl Engine {
    /// Acquires for a BatchAcquire's items, answered in their order, each as
    /// its unary Acquire would be. A batch answers when its last item does,
    /// and an item whose row another session holds may wait up to the
    /// statement timeout, while the leases of the items acquired earlier run
    /// down: each acquired item's lease is held again (see `hold`) before
    /// the answer, counted from its last write.
    pub async fn acquire_many(
        &self,
        requests: Vec<AcquireRequest>,
    ) -> Vec<Result<AcquireOutcome, Error>> {
        let inputs: Vec<Arc<AcquireInput>> = requests
            .into_iter()
            .map(|request| Arc::new(acquire_input(request)))
            .collect();
        let answers = in_rounds(
            &inputs,
            |input| &input.id,
            |round| self.acquire_round(round),
        )
        .await;
        join_in_order(
            inputs
                .iter()
                .zip(answers)
                .map(|(input, answer)| self.keep_live(input, answer)),
        )
        .await
    }

    /// One round: replays from the cache, the rest in one call to the
    /// store, then each of those items' follow-ups, concurrently.
    async fn acquire_round(&self, inputs: Vec<Arc<AcquireInput>>) -> Vec<Result<Answer, Error>> {
        let mut answers: Vec<Option<Result<Answer, Error>>> = inputs
            .iter()
            .map(|input| {
                let replayed = self.replayed(&input.id, &input.fingerprint);
                replayed.map(|outcome| Ok(Answer::Outcome(outcome)))
            })
            .collect();
        let asked: Vec<usize> = (0..inputs.len())
            .filter(|&i| answers[i].is_none())
            .collect();
        if !asked.is_empty() {
            let sent = Instant::now();
            let found = self
                .store
                .insert_or_read_all(asked.iter().map(|&i| inputs[i].clone()).collect())
                .await;
            let settled = join_in_order(
                asked
                    .iter()
                    .zip(found)
                    .map(|(&i, found)| self.settle(&inputs[i], found, sent)),
            )
            .await;
            for (i, answer) in asked.into_iter().zip(settled) {
                answers[i] = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|answer| answer.expect("every item answered"))
            .collect()
    }

    /// An item's answer once its batch is done: a held record's lease is
    /// renewed if half of it passed since it was last written (by the
    /// item's statement, or by a renewal just after it), as answering with
    /// a lease that has passed would let a second caller take the key over,
    /// and both would run the business logic. If it can no longer be
    /// renewed (taken over), the item is answered UNAVAILABLE.
    async fn keep_live(
        &self,
        input: &AcquireInput,
        answer: Result<Answer, Error>,
    ) -> Result<AcquireOutcome, Error> {
        let held = match answer? {
            Answer::Held(held) => held,
            Answer::Outcome(outcome) => return Ok(outcome),
        };
        match self.hold(input, held).await {
            Ok(Some(held)) => Ok(acquired(held.row)),
            lost => {
                let error = lost.err().map(|error| error.to_string());
                tracing::warn!(
                    key = %input.id.key(),
                    error = error.as_deref().unwrap_or("taken over"),
                    "a batched Acquire's lease passed while the batch's other items ran"
                );
                Err(Error::Contention("batch acquire"))
            }
        }
    }

    /// Completes a BatchComplete's items, answered in their order, each as
    /// its unary Complete would be.
    pub async fn complete_many(
        &self,
        requests: Vec<CompleteRequest>,
    ) -> Vec<Result<Timestamp, Error>> {
        let inputs: Vec<_> = requests
            .into_iter()
            .map(|request| Arc::new(finish_input(request, RecordState::Completed)))
            .collect();
        in_rounds(
            &inputs,
            |input| &input.id,
            |round| async move {
                let found = self.store.finish_all(round.clone()).await;
                join_in_order(
                    round
                        .iter()
                        .zip(found)
                        .map(|(input, found)| self.finished(input, found)),
                )
                .await
            },
        )
        .await
    }
}

/// Runs `items` round by round (see [`rounds`]), `run` taking one round's
/// items at once and answering in their order; answers in the items' order.
async fn in_rounds<T: Clone, R, Fut>(
    items: &[T],
    record: impl Fn(&T) -> &RecordId,
    mut run: impl FnMut(Vec<T>) -> Fut,
) -> Vec<R>
where
    Fut: Future<Output = Vec<R>>,
{
    let mut answers: Vec<Option<R>> = items.iter().map(|_| None).collect();
    for round in rounds(items, record) {
        let round_items = round.iter().map(|&i| items[i].clone()).collect();
        for (i, answer) in round.into_iter().zip(run(round_items).await) {
            answers[i] = Some(answer);
        }
    }
    answers
        .into_iter()
        .map(|answer| answer.expect("every item ran"))
        .collect()
}

/// The rule for a batch's items: rounds that hold each record once, in item
/// order, the k-th item for a record in round k, so that it runs after the
/// items before it were answered and sees what they did, as a unary call
/// sent after theirs would. Positions, in item order within each round.
fn rounds<T>(items: &[T], record: impl Fn(&T) -> &RecordId) -> Vec<Vec<usize>> {
    // Keyed (seeded per process), as records are the callers' to choose.
    let mut seen: HashMap<&RecordId, usize, foldhash::fast::RandomState> = HashMap::default();
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (position, item) in items.iter().enumerate() {
        let round = seen.entry(record(item)).or_insert(0);
        if *round == rounds.len() {
            rounds.push(Vec::new());
        }
        rounds[*round].push(position);
        *round += 1;
    }
    rounds
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: &str) -> RecordId {
        RecordId::parse(
            "id",
            "payments".into(),
            "POST /payments".into(),
            String::new(),
            format!("key-{key:0>8}"),
        )
        .unwrap()
    }

    #[test]
    fn a_records_kth_item_runs_in_round_k_in_item_order() {
        let cases: Vec<(&[&str], Vec<Vec<usize>>)> = vec![
            (&[], vec![]),
            (&["a"], vec![vec![0]]),
            (&["a", "b", "c"], vec![vec![0, 1, 2]]),
            (&["a", "a", "a"], vec![vec![0], vec![1], vec![2]]),
            (
                &["a", "b", "a", "c", "a", "b"],
                vec![vec![0, 1, 3], vec![2, 5], vec![4]],
            ),
            (&["b", "a", "a", "b"], vec![vec![0, 1], vec![2, 3]]),
        ];
        for (keys, expected) in cases {
            let ids: Vec<RecordId> = keys.iter().map(|key| id(key)).collect();
            assert_eq!(rounds(&ids, |id| id), expected, "{keys:?}");
        }
    }

    #[test]
    fn records_differ_by_any_part_of_their_id() {
        let parts = |namespace: &str, operation: &str, subject: &str| {
            RecordId::parse(
                "id",
                namespace.into(),
                operation.into(),
                subject.into(),
                "key-00000001".into(),
            )
            .unwrap()
        };
        let ids = [
            parts("payments", "op", ""),
            parts("billing", "op", ""),
            parts("payments", "other", ""),
            parts("payments", "op", "user-1"),
            parts("payments", "op", ""),
        ];
        assert_eq!(rounds(&ids, |id| id), vec![vec![0, 1, 2, 3], vec![4]]);
    }

    #[tokio::test]
    async fn rounds_run_one_after_the_other_and_answers_keep_the_items_order() {
        let ids: Vec<RecordId> = ["a", "b", "a", "a", "c"]
            .iter()
            .map(|key| id(key))
            .collect();
        let mut seen_rounds = Vec::new();
        let answers = in_rounds(
            &ids,
            |id| id,
            |round| {
                seen_rounds.push(
                    round
                        .iter()
                        .map(|id| id.key().to_owned())
                        .collect::<Vec<_>>(),
                );
                async move { round.into_iter().map(|id| id.key().to_owned()).collect() }
            },
        )
        .await;
        let key = |key: &str| format!("key-{key:0>8}");
        assert_eq!(
            seen_rounds,
            vec![
                vec![key("a"), key("b"), key("c")],
                vec![key("a")],
                vec![key("a")]
            ]
        );
        assert_eq!(answers, ["a", "b", "a", "a", "c"].map(key));
    }
}
