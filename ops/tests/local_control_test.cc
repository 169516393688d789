// The in-process control plane, used as the runtime uses MpiContext's:
// workers report to rank 0, which answers every rank.
#include <chrono>
#include <thread>

#include "../core/control/local_control.h"
#include "../core/message.h"
#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;

KD_TEST(ControlMessagesArriveInOrderPerSender) {
  const int kPerRank = 20;
  for (int n = 1; n <= 4; ++n) {
    auto boxes = std::make_shared<LocalMailboxes>(n);
    RunRanks(n, [&](LocalCommunicator& comm) {
      const int me = comm.rank();
      LocalControl control(boxes, me);
      bool got = true;
      int src = -1;
      std::string bytes;
      CHECK_OK(control.PollControl(&got, &src, &bytes));
      CHECK(!got);               // nothing yet, and no wait
      CHECK_OK(comm.Barrier());  // every rank's mailbox exists before sends
      if (me != 0) {
        for (int i = 0; i < kPerRank; ++i) {
          RankMessage m;
          m.cached.push_back(i);
          CHECK_OK(control.SendControl(0, Serialize(m)));
        }
        ReceiveControl(control, &src, &bytes);
        CHECK(src == 0 && bytes == "done " + std::to_string(me));
      } else {
        std::vector<int> next(n, 0);
        for (int k = 0; k < kPerRank * (n - 1); ++k) {
          ReceiveControl(control, &src, &bytes);
          RankMessage m;
          CHECK_OK(Deserialize(bytes, &m));
          CHECK_MSG(m.cached == std::vector<int32_t>{next[src]++},
                    "out of order from rank " + std::to_string(src));
        }
        for (int r = 1; r < n; ++r)
          CHECK_OK(control.SendControl(r, "done " + std::to_string(r)));
      }
      CHECK_OK(comm.Barrier());  // nobody leaves before the answers are read
    });
  }
}

KD_TEST(ControlMessageToARankThatLeftFails) {
  auto boxes = std::make_shared<LocalMailboxes>(3);
  LocalControl zero(boxes, 0);
  {
    LocalControl gone(boxes, 2);
  }
  Status s = zero.SendControl(2, "decision");
  CHECK(s.code() == StatusCode::kAborted);
  CHECK_CONTAINS(s.message(),
                 "control message from rank 0 to rank 2, which left.");
  s = zero.SendControl(3, "x");
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK_CONTAINS(s.message(), "to rank 3, outside [0, 3)");
  CHECK_OK(zero.SendControl(1, "still here"));
}

}  // namespace
}  // namespace kdtest
