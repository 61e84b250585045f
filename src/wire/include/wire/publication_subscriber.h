#pragma once
// The subscriber's end of publication (docs/publication.md, docs/wire-format.md §9.4), whatever
// carries its messages: a pull's request, offer, schema and data over a Link, the checks every
// field of the publisher's must pass, and the copy of a whole version into the caller's
// TensorDict. The transports own the links: tensordict::dist::Subscriber over a c10d group,
// tensordict::pipe::Subscriber over a pipe.

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/metadata.h"
#include "tensordict/publication.h"
#include "tensordict/tensor_dict.h"
#include "wire/publication_link.h"

namespace tensordict::wire::publication {

/// One pull's messages, from its request on: the only state of a pull in flight.
struct Pull;
struct Lane;
struct RelayState;

/// The slots of a relay on this subscriber's host, mapped (§9.9).
struct HostReader;
class RelaySlots;

/// What a subscriber leaves on its link for the next one there (c10d: the next Subscriber of
/// the same group, rank and channel in this process): the pull it left in flight with what it
/// held, or the refusal that ended the link.
struct Leftover;

/// A link to another subscriber of the publication, by its rank (relayed pieces, §9.9);
/// MalformedPeerDataError for a rank that cannot be one. Empty: this transport relays nothing.
using RelayLinks = std::function<std::shared_ptr<Link>(int64_t rank)>;

/// Not thread-safe, but for interrupt(): one thread pulls at a time.
///
/// Every pull leaves by one rule (end_pull): a peer's bytes refused end the link (the
/// publisher is told by a refusal, what was posted stays posted, later pulls raise the same
/// refusal); a clean close or a lost connection ends the pull in flight; a deadline or an
/// interrupt leaves it in flight for the next pull. Every wait is bounded by the pull's
/// deadline and its interrupt.
class SubscriberCore {
 public:
  /// `link`: the publisher's messages. `who` names the pulls in errors ("Subscriber.pull (rank
  /// 0)"); `max_total_bytes` bounds the storage an offer may announce. With a `transport` other
  /// than kSocket, requests ask for shared memory (docs/wire-format.md §9.8), and pulls take
  /// versions from the publisher's slots once it offers them and they map.
  /// With `relay_links`, requests offer to relay (§9.9): a publisher whose route is a chain
  /// may send a version in pieces through other subscribers, and this one forwards the pieces
  /// its route names as they arrive.
  SubscriberCore(std::shared_ptr<Link> link, std::string who, int64_t max_total_bytes,
                 Transport transport = Transport::kSocket, RelayLinks relay_links = {});
  ~SubscriberCore();
  SubscriberCore(const SubscriberCore&) = delete;
  SubscriberCore& operator=(const SubscriberCore&) = delete;

  /// Subscriber::pull (both transports): fills `td` with the newest version newer than the one
  /// held, or returns nothing when the timeout passes first (`td` unchanged); see
  /// tensordict/distributed/publication.h for the errors.
  std::optional<int64_t> pull(TensorDict& td, const PullOptions& options);
  /// The same into a new TensorDict, whose leaves are views of a storage of its own.
  std::optional<Pulled> pull(const PullOptions& options);

  int64_t version() const;
  uint64_t epoch() const;
  /// Whether a pull found the publisher closed (NoPublisherError "closed").
  bool publisher_closed() const { return publisher_closed_; }
  /// "shm", "socket", or "socket (shared memory refused: <why>)".
  std::string transport() const { return transport_text_; }
  /// The relays this subscriber stopped taking pieces from, the newest last, each in words.
  const std::vector<std::string>& routed_around() const { return routed_around_; }
  /// Unpins the slot that the last zero-copy pull left its TensorDict viewing (its views may
  /// then change). Nothing over the socket.
  void release_pin();

  /// Makes the running pull, or the next one, return nothing within a slice of its waits, its
  /// TensorDict unchanged (an event loop's cancelled apull); interrupt(false) withdraws it.
  void interrupt(bool on) { interrupted_.store(on); }

  /// What this subscriber leaves on its link, taken out (null when nothing); adopt() hands it
  /// to another subscriber on the same link, whose first pull finishes the pull in flight.
  std::shared_ptr<Leftover> release();
  void adopt(std::shared_ptr<Leftover> leftover);

  struct Held;
  /// A version to apply, wherever it lies: the link's stage or a slot in shared memory.
  struct Version;

 private:
  struct Mapped;
  // What a pull over shared memory reads: a version newer than the one held (at least
  // min_version), pinned, its schema read; nothing at the deadline or an interrupt, or when
  // the publisher moved its slots (mapped_ is then null: the next request asks again).
  std::optional<Version> shm_next(Clock::time_point deadline, const PullOptions& options);
  // Maps what a kShm offer names; false with the reason in transport_text_ when it cannot.
  bool attach(const Offer& offer);
  void detach();
  void send_request(const PullOptions& options);
  // Runs the pull's messages until a version is in; false when the deadline passed first.
  bool advance(Clock::time_point deadline, const PullOptions& options);
  // The steps of advance(): the request taken (or NoPublisherError), the offer read and
  // checked (then the schema's and the data's receives posted), the version in.
  bool request_taken(Pull& o, Clock::time_point deadline, const PullOptions& options);
  enum class OfferRead { kWaiting, kNone, kNew, kShm };
  OfferRead read_offer(Pull& o, Clock::time_point deadline);
  bool read_version(Pull& o, Clock::time_point deadline);
  // A relayed version (§9.9): its route read, its pieces taken from the parent (or the
  // publisher) and forwarded, lane by lane (two lanes at once on two threads); a parent that
  // stalls, crawls, breaks or forges is left for the publisher, from the piece reached
  // (resume). False at the deadline or an interrupt.
  bool read_route(Pull& o, Clock::time_point deadline);
  bool read_pieces(Pull& o, Clock::time_point deadline);
  bool read_lane(Pull& o, Lane& l, Clock::time_point deadline);
  // A relayed version from the slots of its parent on this host: waits while the parent makes
  // progress, copies and checks it (or leaves it for the publisher: resume). False at the
  // deadline or an interrupt.
  bool read_host(Pull& o, Clock::time_point deadline);
  // Leaves the lane's parent for the publisher, from the piece reached; `blame`: the parent
  // failed (it is routed around), not this subscriber's own means. ask() sends the resume, and
  // says so, once the publisher answers no other lane of the version.
  void resume(Pull& o, Lane& l, Resume why, const std::string& detail, bool blame = true);
  bool ask(Pull& o, Lane& l);
  bool read_resume(Pull& o, Lane& l, Clock::time_point deadline);
  // wait(), also ending when the other lane failed or the version was abandoned.
  bool wait_lane(RelayState& r, Link& link, const PendingPtr& p, Clock::time_point deadline);
  std::shared_ptr<Link> relay_link(int64_t rank);
  // Waits in slices, each looking at the interrupt; false at the deadline or the interrupt.
  // `p` was posted on the publisher's link, or on `link` (a relay's).
  bool wait(const PendingPtr& p, Clock::time_point deadline);
  bool wait(Link& link, const PendingPtr& p, Clock::time_point deadline);
  // The one way out of a pull that failed with `error` (see the class comment): rethrows it,
  // or the error it means.
  [[noreturn]] void end_pull(std::exception_ptr error);
  template <typename Apply>
  auto pull_with(const PullOptions& options, Apply&& apply)
      -> std::optional<std::invoke_result_t<Apply&, const Version&>>;

  std::shared_ptr<Link> link_;
  const Transport transport_;
  const RelayLinks relay_links_;
  // A test hook (TENSORDICT_TEST_RELAY_STALE set): forwards the previous version's bytes as
  // the current one's, which the children (and the readers of its slots) must catch; "slots":
  // only into its slots.
  enum class Stale { kNone, kPieces, kSlots };
  const Stale stale_relay_;
  // A test hook (TENSORDICT_TEST_HOST=<name>): the host this subscriber says it is on, so that
  // processes of one machine play subscribers of different hosts.
  const std::optional<std::string> test_host_;
  std::map<int64_t, std::shared_ptr<Link>> relays_;  // made once per rank: a link keeps a watch
  std::vector<std::string> routed_around_;
  bool relayed_ = false;     // the publisher relayed a version here: it takes the host message
  bool said_host_ = false;   // the host message went
  SlotsPlace said_slots_{};  // with these slots
  std::unique_ptr<RelaySlots> relay_slots_;  // kept for its host, once a route asked
  std::shared_ptr<HostReader> host_reader_;  // the last relay's slots read on this host
  // Piece buffers of the last relayed pull, kept for the next (at most kPiecesAhead): each is
  // the largest piece's size, paged in only as far as pieces were written into it.
  std::vector<at::Tensor> piece_pool_;
  std::string transport_text_ = "socket";
  bool declined_ = false;  // shared memory was refused: the link serves
  Decline declined_for_ = Decline::kOpen;
  std::unique_ptr<Mapped> mapped_;  // the publisher's slots, while pulls take them there
  const std::string who_;
  const int64_t max_total_bytes_;
  std::unique_ptr<Held> held_;
  uint64_t seq_ = 0;
  std::shared_ptr<Pull> pull_;  // the pull in flight, or null
  std::string ended_;           // why the link ended (a refusal); "" while it serves
  std::atomic<bool> interrupted_{false};
  bool publisher_closed_ = false;
  bool answered_ = false;  // a request was taken: a publisher runs there
  at::Tensor stage_;       // where data lands (recv_buffer: with room); kept between pulls
  // The stage's leaves as views, for the schema they were made for.
  std::vector<std::pair<std::vector<std::string>, at::Tensor>> stage_views_;
  const void* stage_views_for_ = nullptr;
  uint64_t stage_views_schema_ = 0;
};

}  // namespace tensordict::wire::publication
