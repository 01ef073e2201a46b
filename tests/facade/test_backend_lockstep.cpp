// The lockstep the GPU suite runs against CudaBackend (tests/gpu/test_cuda_backend.cpp),
// here against its host twin: a backend whose copies stay in flight until
// the step needs them. Tiers sized from each policy, so arrivals beyond them
// are refused on both managers alike; outputs equal bit for bit.
#include "backend_lockstep.hpp"
#include "deferred_backend.hpp"

using namespace sparsekv;
using namespace sparsekv::test;

TEST_CASE("Lockstep: the GPU suite's request mix on a deferred-copy backend matches the host backend",
          "[facade][backend]") {
  const LockstepShape s;
  for (const std::string& name : policy_names()) {
    INFO(name);
    const Config config = lockstep_config(s, name);
    RuntimeManager host(s.shape, config, make_policy(name, s.budget_tokens));
    RuntimeManager deferred(s.shape, config, make_policy(name, s.budget_tokens), std::make_unique<DeferredBackend>());
    const LockstepResult r = lockstep(host, deferred, s, 11, 0.0);
    CHECK(r.admitted >= s.fitting_requests);
    CHECK(r.refused > 0);        // the tiers hold fitting_requests of the largest size: the refusal path ran
    CHECK(r.decode_steps > 50);  // batched layer steps
  }
}
