// SHA-256 and HMAC-SHA256 (core/control/hmac.h) against the published test
// vectors: FIPS 180-4's examples and RFC 4231's HMAC-SHA256 cases.
#include "../core/control/hmac.h"

#include <string>

#include "harness.h"

namespace kdtest {
namespace {

using namespace kerasdist::core;

std::string Hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string Bytes(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  }
  return out;
}

KD_TEST(Sha256MatchesFips180Examples) {
  CHECK(Hex(Sha256("")) ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(Hex(Sha256("abc")) ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(
      Hex(Sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")) ==
      "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(Hex(Sha256(std::string(1000000, 'a'))) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // 55, 56 and 64 bytes: the padding's one-block and two-block edges.
  CHECK(Hex(Sha256(std::string(55, 'a'))) ==
        "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  CHECK(Hex(Sha256(std::string(56, 'a'))) ==
        "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  CHECK(Hex(Sha256(std::string(64, 'a'))) ==
        "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

KD_TEST(HmacSha256MatchesRfc4231) {
  struct Case {
    std::string key, data, mac;
  };
  const Case cases[] = {
      {std::string(20, '\x0b'), "Hi There",
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {std::string(20, '\xaa'), std::string(50, '\xdd'),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {Bytes("0102030405060708090a0b0c0d0e0f10111213141516171819"),
       std::string(50, '\xcd'),
       "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {std::string(131, '\xaa'),
       "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {std::string(131, '\xaa'),
       "This is a test using a larger than block-size key and a larger "
       "than block-size data. The key needs to be hashed before being "
       "used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const Case& c : cases) CHECK(Hex(HmacSha256(c.key, c.data)) == c.mac);
  // Case 5: the first 128 bits.
  CHECK(Hex(HmacSha256(std::string(20, '\x0c'), "Test With Truncation"))
            .substr(0, 32) == "a3b6167473100ee06e0c796c2955552b");
}

KD_TEST(EqualInConstantTimeAndRandomBytes) {
  CHECK(EqualInConstantTime("abc", "abc"));
  CHECK(!EqualInConstantTime("abc", "abd"));
  CHECK(!EqualInConstantTime("abc", "ab"));
  const std::string a = RandomBytes(32), b = RandomBytes(32);
  CHECK(a.size() == 32 && b.size() == 32 && a != b);
}

}  // namespace
}  // namespace kdtest
